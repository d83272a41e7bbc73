"""How often the critical-regime test calls a layer critical, bare and with its noise.

Trains one of the trainer's models (``--model``: the CNN or the MLP) on Fashion-MNIST
in one process, SGD with momentum 0.9, the learning rate falling to a tenth at three
quarters of the steps, and keeps every step's gradient. For each interval length of
``--every`` it cuts the steps into intervals, takes each layer's interval norm as
``compressor="auto"`` does (``planner.interval_norm``: the norm of the interval's mean,
the noise it may carry and the steps' spread, from the steps' squared norms) and
counts, at each interval's end, the layers ``planner.critical_layers`` calls critical
at ``--threshold`` with ``noise`` 0 (ACCORDION's bare test) and 1 (the default: moves
within the noise left out, the spread's moves counted). The first interval is
critical by rule and not counted. ``--seeds`` repeats the run (about a minute each).

    python benchmarks/regimes.py
    python benchmarks/regimes.py --model mlp --every 25 100 --seeds 0 1 2

The step's gradient here is one process's batch; on a cluster it is the workers'
reduced one, over their batches together (``--batch`` the global batch).
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

from tfgc.apps.data import load_dataset  # noqa: E402
from tfgc.apps.models import build_model  # noqa: E402
from tfgc.distribute import planner  # noqa: E402

NOISES = (0.0, 1.0)


def gradients(model_name, steps, batch, rate, seed):
    """Every step's gradients (float64 vectors by layer) of a run of ``steps`` steps."""
    tf.keras.utils.set_random_seed(seed)
    data = load_dataset("fashion_mnist")
    model = build_model(model_name, data.input_shape, data.num_classes, seed=seed)
    optimizer = keras.optimizers.SGD(rate, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    order = np.random.default_rng(seed).permutation(len(data.x_train))
    out = []
    for k in range(steps):
        if k == steps * 3 // 4:
            optimizer.learning_rate.assign(rate / 10)
        take = order[(k * batch) % (len(order) - batch):][:batch]
        out.append([g.numpy().astype(np.float64).ravel()
                    for g in step(data.x_train[take], data.y_train[take])])
    return out


def interval_norms(steps):
    """The layers' (mean, noise, level) over ``steps`` (their gradients), by place."""
    norms = {}
    for j in range(len(steps[0])):
        total = sum(s[j] for s in steps)
        squares = sum(float(s[j] @ s[j]) for s in steps)
        norms[j] = planner.interval_norm(float(np.linalg.norm(total)), squares, len(steps))
    return norms


def counts(per_step, every, threshold):
    """By noise: the layers called critical at each interval's end after the first, and
    the intervals' norms."""
    intervals = [interval_norms(per_step[k:k + every])
                 for k in range(0, len(per_step) - every + 1, every)]
    out = {noise: [len(planner.critical_layers(before, now, threshold, noise))
                   for before, now in zip(intervals, intervals[1:])] for noise in NOISES}
    return out, intervals


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rate", type=float, default=0.05)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--every", type=int, nargs="+", default=[25, 100])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    decay = args.steps * 3 // 4
    print(f"{args.model}, {args.steps} steps of {args.batch}, SGD {args.rate:g} momentum "
          f"0.9, a tenth from step {decay}; threshold {args.threshold:g}")
    for seed in args.seeds:
        per_step = gradients(args.model, args.steps, args.batch, args.rate, seed)
        layers = len(per_step[0])
        for every in args.every:
            found, intervals = counts(per_step, every, args.threshold)
            below = sum(mean < noise for norms in intervals for mean, noise, _ in norms.values())
            print(f"seed {seed}, every {every} steps ({len(intervals)} intervals, "
                  f"{layers} layers; the decay ends interval {decay // every - 1}); "
                  f"layers' means below their noise: {below} of {layers * len(intervals)}")
            for noise in NOISES:
                row = found[noise]
                print(f"  noise {noise:g}: critical at {sum(c > 0 for c in row)} of "
                      f"{len(row)} ends, {sum(row)} layers in all: {row}")


if __name__ == "__main__":
    main()
