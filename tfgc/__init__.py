"""tfgc: gradient compression for TensorFlow multi-worker training.

Swap ``tf.distribute.MultiWorkerMirroredStrategy`` for
``tfgc.CompressedMultiWorkerMirroredStrategy(compressor="ef+topk:ratio=0.01")`` and the
gradients that cross the network are compressed, reduced over TensorFlow's own
collective runtime, and decompressed inside ``model.fit`` or a custom loop.

Attributes load lazily, so ``tfgc-launch`` and ``tfgc-train --help`` start without
importing TensorFlow.
"""

import importlib as _importlib
import os as _os

# ``tf.keras`` resolves to tf-keras (Keras 2) for scripts that import tfgc before
# touching it: tfgc's own Keras pieces (tfgc.keras, tfgc.apps.models) are tf-keras. Keras 3
# (``import keras``) trains under tfgc's strategy too.
_os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

__version__ = "0.1.0"

_EXPORTS = {
    "CompressedAllReduce": "tfgc.distribute.cross_device_ops",
    "CompressedMultiWorkerMirroredStrategy": "tfgc.distribute.strategy",
    "CompressionPolicy": "tfgc.distribute.policy",
    "compress_gradients": "tfgc.distribute.gradients",
    "Compressor": "tfgc.compressors",
    "ErrorFeedback": "tfgc.compressors",
    "get_compressor": ("tfgc.compressors", "get"),
    "serialize": "tfgc.compressors",
    "recommended": "tfgc.compressors",
}
_SUBMODULES = ("apps", "compressors", "collectives", "distribute", "keras", "ops")

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        target = _EXPORTS[name]
        module, attr = target if isinstance(target, tuple) else (target, name)
        value = getattr(_importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return _importlib.import_module(f"tfgc.{name}")
    raise AttributeError(f"module 'tfgc' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS) + list(_SUBMODULES))
