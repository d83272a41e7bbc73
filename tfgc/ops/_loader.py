"""Lazy loading of tfgc's compiled TensorFlow op library.

The library (``_tfgc_ops.so`` next to this file, built by ``setup.py``) is
optional: every op has a pure-TensorFlow reference that is used whenever the
library is missing, fails to load, or is switched off with
``TFGC_DISABLE_CUSTOM_OPS=1``.

``TFGC_DISABLE_CUSTOM_OPS`` is read on every call rather than once at import so
that tests (and users debugging a numerical difference) can flip between the
two implementations inside one process. Ops dispatch when they are called, so
inside a ``tf.function`` the choice is made at trace time.
"""

import os
import threading

from absl import logging

LIBRARY_NAME = "_tfgc_ops.so"
DISABLE_ENV_VAR = "TFGC_DISABLE_CUSTOM_OPS"
# Loads the library from another path (a private build, a packaged copy).
LIBRARY_ENV_VAR = "TFGC_OPS_LIBRARY"

_lock = threading.Lock()
_attempted = False
_library = None


def library_path():
    """Absolute path where the compiled op library is expected.

    ``TFGC_OPS_LIBRARY`` overrides the default, the library next to this file.
    """
    override = os.environ.get(LIBRARY_ENV_VAR, "").strip()
    if override:
        return os.path.abspath(override)
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)


def custom_ops_disabled():
    """True when ``TFGC_DISABLE_CUSTOM_OPS`` asks for the reference ops."""
    value = os.environ.get(DISABLE_ENV_VAR, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _load():
    # Imported here so that importing tfgc.ops does not import TensorFlow.
    import tensorflow as tf

    path = library_path()
    if not os.path.exists(path):
        logging.warning(
            "tfgc: custom op library %s not found; using the pure-TensorFlow "
            "reference ops. Build it with `python setup.py build_ext --inplace` "
            "or `pip install --no-build-isolation -e .`.", path)
        return None
    try:
        return tf.load_op_library(path)
    except Exception as exc:  # pylint: disable=broad-except
        # Typically an ABI mismatch after a TensorFlow upgrade: the reference
        # ops keep training working, just slower.
        logging.warning(
            "tfgc: could not load custom op library %s (%s: %s); using the "
            "pure-TensorFlow reference ops. Rebuild it against the installed "
            "TensorFlow.", path, type(exc).__name__, exc)
        return None


def load_library():
    """Returns the loaded op module, or None if the references must be used.

    The shared library is loaded at most once per process, on the first call
    that is not disabled; a failure is logged once and remembered.
    """
    global _attempted, _library
    if custom_ops_disabled():
        return None
    if not _attempted:
        with _lock:
            if not _attempted:
                _library = _load()
                _attempted = True
    return _library


def custom_ops_available():
    """True when calls will currently run the compiled kernels."""
    return load_library() is not None
