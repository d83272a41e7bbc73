"""What the per-sample second moments of variance-based compression cost.

Times one training step's gradient computation (forward, loss, ``tape.gradient``)
of the trainer's MLP (784-256-128-10) and of a wide one (784-2048-2048-10) built
with ``tfgc.keras.MomentDense`` against the same model with ``keras.layers.Dense``,
in one process. Median of ``--repeats`` runs of ``--steps`` steps each after a
warm-up, and the ratio to Dense measured in the same run.

    python benchmarks/moments.py
    python benchmarks/moments.py --batch 64 --repeats 9
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from tfgc.keras import MomentDense  # noqa: E402

MODELS = {"mlp 784-256-128-10": [256, 128], "wide 784-2048-2048-10": [2048, 2048]}


def build(hidden, layer):
    model = keras.Sequential([keras.Input((784,))] + [layer(h, activation="relu") for h in hidden]
                             + [layer(10)])
    return model


def step_ms(model, x, y, steps, repeats):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    grads()  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            out = grads()
        _ = [g.numpy() for g in out[:1]]
        times.append((time.perf_counter() - start) * 1000 / steps)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(args.batch, 784)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, args.batch))
    print(f"gradient step (forward + backward), batch {args.batch}, median of {args.repeats} "
          f"x {args.steps} steps, {os.cpu_count()} CPU cores")
    print(f"| model | Dense ms | MomentDense ms | ratio |\n|---|---|---|---|")
    for name, hidden in MODELS.items():
        dense = step_ms(build(hidden, keras.layers.Dense), x, y, args.steps, args.repeats)
        moment = step_ms(build(hidden, MomentDense), x, y, args.steps, args.repeats)
        print(f"| {name} | {dense:.2f} | {moment:.2f} | {moment / dense:.2f} |", flush=True)


if __name__ == "__main__":
    main()
