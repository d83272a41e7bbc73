"""Lazy loading of tfgc's compiled TensorFlow op library.

The library (``_tfgc_ops.so``) is optional: every op has a pure-TensorFlow
reference that is used whenever no library can be loaded, or when
``TFGC_DISABLE_CUSTOM_OPS=1`` asks for the references.

Where the library comes from, first match wins:

1. ``TFGC_OPS_LIBRARY``: an explicit path (a private build, a packaged copy);
2. ``_tfgc_ops.so`` next to this file, built by ``setup.py`` when TensorFlow
   was importable during the install (``pip install --no-build-isolation``,
   ``python setup.py build_ext --inplace``);
3. the per-user build cache (see ``tfgc.ops.build``), compiled on first use
   for the running TensorFlow. This is the path after a plain ``pip install
   .``/``pip install -e .``: pip's isolated build cannot see TensorFlow.
   ``TFGC_JIT_BUILD=0`` turns the automatic build off (an existing cached
   library is still used).

When none of them works, one warning per process says why and how to fix it.

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
# "0" stops the loader from compiling the library into the cache at first use.
JIT_ENV_VAR = "TFGC_JIT_BUILD"

BUILD_COMMAND = "python -m tfgc.ops.build"
REINSTALL_COMMAND = "pip install --no-build-isolation --force-reinstall --no-deps ."

_lock = threading.Lock()
_attempted = False
_library = None
_loaded_path = None


def _build():
    # Imported on use: ``python -m tfgc.ops.build`` imports this package first, and runpy
    # warns when the module it is about to run was already imported by it.
    from tfgc.ops import build  # pylint: disable=import-outside-toplevel

    return build


def packaged_library_path():
    """The library built by setup.py, next to this file (may not exist)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)


def _cached_library_path():
    """Cache path of the library for the running TensorFlow, or None.

    Imports TensorFlow (the cache key contains its version and flags).
    """
    src_root = _build().find_source_root()
    if src_root is None:
        return None
    return _build().cached_library_path(_build().tensorflow_build_info_in_process(), src_root)


def library_path():
    """Absolute path of the library that is (or would be) loaded.

    ``TFGC_OPS_LIBRARY`` if set; else the library next to this file if it
    exists; else its place in the build cache for the running TensorFlow,
    which exists once it has been built. Does not build anything.
    """
    override = os.environ.get(LIBRARY_ENV_VAR, "").strip()
    if override:
        return os.path.abspath(override)
    if _loaded_path is not None:
        return _loaded_path
    packaged = packaged_library_path()
    if os.path.exists(packaged):
        return packaged
    return _cached_library_path() or packaged


def loaded_library_path():
    """Path of the library this process loaded, or None (not loaded yet, or none)."""
    return _loaded_path


def custom_ops_disabled(env=None):
    """True when ``TFGC_DISABLE_CUSTOM_OPS`` (in ``env``, default this process's
    environment) asks for the reference ops."""
    value = (os.environ if env is None else env).get(DISABLE_ENV_VAR, "")
    return value.strip() != "" and not _build().falsy(value)


def jit_build_enabled(env=None):
    """False when ``TFGC_JIT_BUILD`` (in ``env``, default this process's
    environment) turns off building the library at first use."""
    return not _build().falsy((os.environ if env is None else env).get(JIT_ENV_VAR, "1"))


def _fallback(cause, fix):
    """The one warning a process gets when it runs the reference ops."""
    logging.warning(
        "tfgc: using the slower pure-TensorFlow reference ops instead of the compiled "
        "kernels: %s. To fix: %s", cause, fix)
    return None


def _try_load(tf, path):
    """(module, None) or (None, "Error: message")."""
    try:
        return tf.load_op_library(path), None
    except Exception as exc:  # pylint: disable=broad-except
        # Typically an ABI mismatch after a TensorFlow upgrade.
        return None, f"{type(exc).__name__}: {exc}"


def _load_from_cache(tf, stale=None):
    """Loads the library from the build cache, compiling it first if needed."""
    global _loaded_path
    prefix = f"{stale}; " if stale else ""
    build = _build()
    src_root = build.find_source_root()
    if src_root is None:
        return _fallback(
            prefix + "no compiled library is installed and this installation has no C++ "
            "sources to build one", f"reinstall tfgc from its source tree with "
            f"`{REINSTALL_COMMAND}` (TensorFlow must be installed first)")
    info = build.tensorflow_build_info_in_process()
    path = build.cached_library_path(info, src_root)
    if not os.path.exists(path):
        if not jit_build_enabled():
            return _fallback(
                prefix + f"no library is built for TensorFlow {info['version']} and "
                f"{JIT_ENV_VAR}=0 turns off building it at first use",
                f"run `{BUILD_COMMAND}` once")
        try:
            path = build.build_cached(info, src_root, notify=logging.warning,
                                      done=logging.info)
        except build.BuildError as exc:
            where = f" (compiler output in {exc.log_path})" if exc.log_path else ""
            return _fallback(f"{prefix}building them failed: {exc}{where}",
                             f"fix the cause and run `{BUILD_COMMAND} --force`")
        except Exception as exc:  # pylint: disable=broad-except
            # An optional speed-up must never stop training.
            return _fallback(f"{prefix}building them failed ({type(exc).__name__}: {exc})",
                             f"run `{BUILD_COMMAND} --force` to see the full error")
    library, error = _try_load(tf, path)
    if library is None:
        return _fallback(f"{prefix}could not load {path} ({error})",
                         f"run `{BUILD_COMMAND} --force`")
    _loaded_path = path
    logging.info("tfgc: loaded custom ops from %s", path)
    return library


def _load():
    # Imported here so that importing tfgc.ops does not import TensorFlow.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    global _loaded_path
    override = os.environ.get(LIBRARY_ENV_VAR, "").strip()
    if override:
        path = os.path.abspath(override)
        if not os.path.exists(path):
            return _fallback(f"{LIBRARY_ENV_VAR}={path} does not exist",
                             f"point {LIBRARY_ENV_VAR} at a built library or unset it")
        library, error = _try_load(tf, path)
        if library is None:
            return _fallback(f"could not load {path} ({error})",
                             f"rebuild it against the installed TensorFlow or unset "
                             f"{LIBRARY_ENV_VAR}")
        _loaded_path = path
        return library

    packaged = packaged_library_path()
    stale = None
    if os.path.exists(packaged):
        library, error = _try_load(tf, packaged)
        if library is not None:
            _loaded_path = packaged
            return library
        # Built for another TensorFlow: a build for this one in the cache
        # keeps the kernels in use.
        stale = f"the installed library {packaged} does not load ({error})"
        logging.info("tfgc: %s; using a build for this TensorFlow from the cache.", stale)
    return _load_from_cache(tf, stale)


def load_library():
    """Returns the loaded op module, or None if the references must be used.

    The shared library is loaded at most once per process, on the first call
    that is not disabled (compiling it into the cache first if necessary); a
    failure is logged once and remembered.
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


def _reset_for_tests():
    """Forgets the outcome of the last load so that the next call retries."""
    global _attempted, _library, _loaded_path
    with _lock:
        _attempted, _library, _loaded_path = False, None, None
