"""A user's own model and data set for ``tfgc-train --model=user_task:build
--dataset=user_task:load``: three Gaussian blobs in 20 dimensions, and a small MLP
whose last layer ends in a softmax (so the trainer must not treat it as logits)."""

import numpy as np
import tf_keras as keras


def build(input_shape, num_classes, seed):
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Dense(64, activation="relu", kernel_initializer=init),
        keras.layers.Dense(num_classes, activation="softmax", kernel_initializer=init)])


def load(seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(3, 20)) * 1.5

    def part(n):
        y = rng.integers(0, 3, n)
        return (centers[y] + rng.normal(size=(n, 20))).astype(np.float32), y

    return part(2560), part(600)
