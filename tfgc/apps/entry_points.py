"""Users' own models and data sets, named as ``package.module:function``.

``tfgc-train --model=mypkg.nets:build --dataset=mypkg.data:load`` (and
``tfgc.apps.models.build_model`` / ``tfgc.apps.data.load_dataset`` with the same strings) run
a user's network and data through the trainer's flags, launcher and stock-strategy
comparison. The signatures:

``build(input_shape, num_classes, seed) -> tf_keras.Model``
    An uncompiled tf-keras model (``import tf_keras as keras``). Its output is taken
    as logits unless its last layer ends in a softmax. The function may accept any
    subset of the three arguments (by name); ``seed`` is the same on every worker, so
    seeding the initializers with it gives every worker the same starting weights
    (tf-keras also seeds its global generator with ``--seed`` before building).

``load(seed) -> tfgc.apps.data.Dataset | ((x_train, y_train), (x_test, y_test))``
    NumPy arrays, as ``keras.datasets.*.load_data()`` returns them; ``seed`` is
    optional. Labels are integer class ids; images may be uint8 (scaled to [0, 1]) or
    float. Every worker calls it and trains on its own shard of the training set.

The module is imported from ``sys.path`` with the current directory first, so a file
next to where the trainer is started is found as well as an installed package.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from typing import Any, Callable

import numpy as np

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_entry_point(name: Any) -> bool:
    """True when ``name`` has the ``package.module:function`` form."""
    return isinstance(name, str) and bool(_SPEC.match(name.strip()))


def _cwd_on_path():
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def module_exists(spec: str) -> bool:
    """Whether the module that ``spec`` names is on the path (the current directory
    included). The module itself is located, not imported; its parent packages, for a
    dotted name, are imported (locating a submodule needs them)."""
    _cwd_on_path()
    try:
        return importlib.util.find_spec(spec.strip().split(":", 1)[0]) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def resolve(spec: str, what: str) -> Callable:
    """The callable that ``spec`` (``package.module:attr.path``) names.

    ``what`` names the argument in the error messages (``"--model"``, ...).
    """
    spec = spec.strip()
    if not is_entry_point(spec):
        raise ValueError(f"{what}={spec!r} is not of the form package.module:function")
    module_name, attr_path = spec.split(":", 1)
    _cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ValueError(f"{what}={spec!r}: no module named {exc.name!r} on the Python path "
                             f"(the current directory {os.getcwd()!r} included)") from exc
        raise
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what}={spec!r}: module {module_name!r} has no attribute "
                             f"{attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{what}={spec!r}: {attr_path!r} is a {type(target).__name__}, "
                         "not a function")
    return target


def _call_with(fn: Callable, **kwargs):
    """Calls ``fn`` with those of ``kwargs`` that its signature accepts."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def build_user_model(spec: str, input_shape, num_classes: int, seed: int = 0):
    """Builds the model of ``spec`` and checks that it is a tf-keras model."""
    import tf_keras as keras

    model = _call_with(resolve(spec, "--model"), input_shape=tuple(input_shape),
                       num_classes=int(num_classes), seed=int(seed))
    if not isinstance(model, keras.Model):
        kind = type(model)
        hint = ""
        if kind.__module__.split(".")[0] == "keras":
            hint = (" It is a Keras 3 model: build it with `import tf_keras as keras` (the "
                    "trainer's models, data and callbacks are tf-keras; Keras 3 models train "
                    "under tfgc.CompressedMultiWorkerMirroredStrategy in a script of your own).")
        raise TypeError(f"--model={spec!r} returned a {kind.__module__}.{kind.__name__}, not a "
                        f"tf_keras.Model.{hint}")
    return model


def outputs_probabilities(model) -> bool:
    """True when the model's last layer ends in a softmax (its output is not logits)."""
    import tf_keras as keras

    if not model.layers:
        return False
    last = model.layers[-1]
    if isinstance(last, keras.layers.Softmax):
        return True
    activation = getattr(last, "activation", None)
    return activation is keras.activations.softmax


def load_user_dataset(spec: str, dataset_type, seed: int = 0):
    """Loads the data set of ``spec`` as a ``dataset_type`` (``tfgc.apps.data.Dataset``, which
    ``tfgc.apps.data.load_dataset`` hands in: data imports this module, not the reverse)."""
    loaded = _call_with(resolve(spec, "--dataset"), seed=int(seed))
    if isinstance(loaded, dataset_type):
        return loaded
    try:
        (x_train, y_train), (x_test, y_test) = loaded
    except (TypeError, ValueError):
        raise TypeError(f"--dataset={spec!r} must return a tfgc.apps.data.Dataset or "
                        "((x_train, y_train), (x_test, y_test)); got "
                        f"{type(loaded).__name__}") from None
    x_train, x_test = _images(x_train, "x_train", spec), _images(x_test, "x_test", spec)
    y_train, y_test = _labels(y_train, "y_train", spec), _labels(y_test, "y_test", spec)
    for x, y, part in ((x_train, y_train, "train"), (x_test, y_test, "test")):
        if len(x) != len(y):
            raise ValueError(f"--dataset={spec!r}: {len(x)} {part} examples but {len(y)} labels")
        if not len(x):
            raise ValueError(f"--dataset={spec!r}: the {part} set is empty")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"--dataset={spec!r}: train examples are {x_train.shape[1:]} but test "
                         f"examples {x_test.shape[1:]}")
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    return dataset_type(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test,
                        num_classes=num_classes, name=spec)


def _images(x, part: str, spec: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"--dataset={spec!r}: {part} must have a batch dimension and at least "
                         f"one feature dimension, got shape {x.shape}")
    if x.dtype == np.uint8:
        return (x.astype(np.float32) / np.float32(255.0))
    if not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"--dataset={spec!r}: {part} has dtype {x.dtype}, not a number type")
    return x.astype(np.float32, copy=False)


def _labels(y, part: str, spec: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"--dataset={spec!r}: {part} must be integer class ids of shape [n] "
                         f"(or [n, 1]); got dtype {y.dtype}, shape {y.shape}")
    if y.size and y.min() < 0:
        raise ValueError(f"--dataset={spec!r}: {part} has a negative class id ({y.min()})")
    return y.astype(np.int32)
