"""TensorFlow ops used by the compressors.

Compiled kernels (``_tfgc_ops.so``) are loaded lazily on first use; each op has
a pure-TensorFlow ``*_reference`` twin that serves as the fallback and as the
test oracle. Set ``TFGC_DISABLE_CUSTOM_OPS=1`` to force the references.

Importing this package does not import TensorFlow; the op functions are
resolved on first attribute access.
"""

import importlib as _importlib

from tfgc.ops._loader import custom_ops_available, custom_ops_disabled, library_path, load_library

_SIGN_BITS_EXPORTS = (
    "OneBitQuantized",
    "onebit_dequantize",
    "onebit_dequantize_reference",
    "onebit_quantize",
    "onebit_quantize_reference",
    "pack_sign_bits",
    "pack_sign_bits_reference",
    "unpack_sign_bits",
    "unpack_sign_bits_reference",
)

__all__ = sorted(
    ("custom_ops_available", "custom_ops_disabled", "library_path", "load_library")
    + _SIGN_BITS_EXPORTS)


def __getattr__(name):
    if name in _SIGN_BITS_EXPORTS:
        value = getattr(_importlib.import_module("tfgc.ops.sign_bits"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfgc.ops' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
