"""Small reference models for the examples, benchmarks and tests.

Built with tf-keras (Keras 2) because multi-worker ``model.fit`` under
MultiWorkerMirroredStrategy (and our subclass of it) is supported there;
Keras 3 takes a different distribution path.

Both models return logits (no softmax), so pair them with
``SparseCategoricalCrossentropy(from_logits=True)``; that is numerically more
stable than softmax followed by log.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

__all__ = ["build_model", "MODEL_NAMES"]


def _layer_seeds(seed: int, count: int) -> list[int]:
    # Derive independent per-layer seeds from one user seed.  SeedSequence
    # avoids the overlap of naive schemes like seed + i, where model seed 0's
    # second layer would share its initializer seed with model seed 1's first.
    state = np.random.SeedSequence(int(seed)).generate_state(count, dtype=np.uint32)
    return [int(s) & 0x7FFFFFFF for s in state]  # keep within int32 for TF


def _mlp(keras, input_shape, num_classes, seeds, dense):
    init = keras.initializers
    return [
        keras.layers.Flatten(name="flatten"),
        dense(256, activation="relu", name="dense_256",
              kernel_initializer=init.GlorotUniform(seed=seeds[0])),
        dense(128, activation="relu", name="dense_128",
              kernel_initializer=init.GlorotUniform(seed=seeds[1])),
        dense(num_classes, name="logits", kernel_initializer=init.GlorotUniform(seed=seeds[2])),
    ]


def _cnn(keras, input_shape, num_classes, seeds, dense):
    init = keras.initializers
    return [
        keras.layers.Conv2D(32, 3, activation="relu", name="conv_32",
                            kernel_initializer=init.GlorotUniform(seed=seeds[0])),
        keras.layers.MaxPooling2D(name="pool_1"),
        keras.layers.Conv2D(64, 3, activation="relu", name="conv_64",
                            kernel_initializer=init.GlorotUniform(seed=seeds[1])),
        keras.layers.MaxPooling2D(name="pool_2"),
        keras.layers.Flatten(name="flatten"),
        dense(128, activation="relu", name="dense_128",
              kernel_initializer=init.GlorotUniform(seed=seeds[2])),
        dense(num_classes, name="logits", kernel_initializer=init.GlorotUniform(seed=seeds[3])),
    ]


_BUILDERS: dict[str, tuple[Callable, int]] = {
    # name -> (layer factory, number of seeded layers)
    "mlp": (_mlp, 3),
    "cnn": (_cnn, 4),
}
MODEL_NAMES = tuple(_BUILDERS)


def build_model(name: str, input_shape: Sequence[int] = (28, 28, 1),
                num_classes: int = 10, seed: int = 0, moments: bool = False):
    """Build an uncompiled ``tf_keras.Sequential`` model that outputs logits, or a
    user's model named ``package.module:build_fn`` (see ``tfgc.apps.entry_points``;
    ``moments`` does not apply to it).

    Same ``seed`` -> identical initial weights (biases start at zero), which
    matters for multi-worker runs: every worker must start from the same
    weights, and comparisons between compressors should share a starting point.
    Call it inside ``strategy.scope()`` to get distributed variables.
    ``moments=True`` builds the dense layers as ``tfgc.keras.MomentDense`` (the same
    weights and outputs), for compressors that read per-sample second moments
    (``"variance"``).
    """
    from tfgc.apps import entry_points
    if entry_points.is_entry_point(name):
        return entry_points.build_user_model(name, input_shape, num_classes, seed)
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}, "
                         "or package.module:build_fn")
    if int(num_classes) < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    import tf_keras as keras  # lazy: importing TensorFlow is slow

    factory, n_seeded = _BUILDERS[key]
    if moments:
        from tfgc.keras.moments import MomentDense as dense
    else:
        dense = keras.layers.Dense
    layers = factory(keras, tuple(input_shape), int(num_classes), _layer_seeds(seed, n_seeded),
                     dense)
    model = keras.Sequential(
        [keras.Input(shape=tuple(input_shape), name="image")] + layers, name=key)
    return model
