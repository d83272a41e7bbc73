"""TensorFlow ops used by the compressors.

Compiled kernels (``_tfgc_ops.so``) are loaded lazily on first use; each op has
a pure-TensorFlow ``*_reference`` twin that serves as the fallback and as the
test oracle. Set ``TFGC_DISABLE_CUSTOM_OPS=1`` to force the references.

Importing this package does not import TensorFlow; the op functions are
resolved on first attribute access.
"""

import importlib as _importlib

from tfgc.ops._loader import custom_ops_available, custom_ops_disabled, library_path, load_library

# Public name -> module under tfgc.ops that defines it.
_EXPORTS = {}
for _module, _names in {
    "sign_bits": ("OneBitQuantized", "onebit_dequantize", "onebit_dequantize_reference",
                  "onebit_quantize", "onebit_quantize_reference", "pack_sign_bits",
                  "pack_sign_bits_reference", "unpack_sign_bits", "unpack_sign_bits_reference"),
    "sparsify": ("Sparsified", "scatter_add_payloads", "scatter_add_payloads_reference",
                 "sparsify_by_threshold", "sparsify_by_threshold_reference",
                 "sparsify_with_residual", "sparsify_with_residual_reference"),
    "quantize": ("Quantized", "dequantize_bucketed", "dequantize_bucketed_reference",
                 "dequantize_bucketed_sum", "dequantize_bucketed_sum_reference",
                 "quantize_bucketed", "quantize_bucketed_reference"),
    "threshold": ("ThresholdEncoded", "threshold_decode", "threshold_decode_reference",
                  "threshold_encode", "threshold_encode_reference"),
    "rotation": ("block_hadamard", "block_hadamard_reference"),
}.items():
    _EXPORTS.update({_name: _module for _name in _names})

__all__ = sorted(
    ("custom_ops_available", "custom_ops_disabled", "library_path", "load_library")
    + tuple(_EXPORTS))


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(f"tfgc.ops.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfgc.ops' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
