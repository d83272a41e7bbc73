"""A cluster worker for the quantized reduce-scatter / all-gather.

    reduce_scatter.py OUT_DIR

For each compressor in SPECS (one strategy, ``communication="reduce_scatter"``, the
compressor switched between runs, a fresh owner each time) reduces deterministic
per-worker "gradients" for STEPS steps (1-bit SGD one more, with a NaN on the last
worker): a [16, 32] and a [3, 10] matrix
(compressed; the second has fewer rows than 4 workers, so it is cut per element)
and a [40] vector (dense). Writes every step's results, both residuals of every
compressed gradient and the byte figures. Then trains the MLP for a few steps
with 1-bit SGD the same way and saves its weights.
"""

import json
import os
import sys

import numpy as np

STEPS = 4
SPECS = ["onebit", "efsignsgd", "signsgd", "qsgd:levels=7,bucket_size=128", "terngrad",
         "onebit:momentum=0.9", "fp16", "bf16",
         # Rotated: chunks of whole blocks, and a tail block (30 elements) padded.
         "qsgd:levels=7,bucket_size=16,norm=max,rotate=true"]
SHAPES = [(16, 32), (3, 10), (40,)]
# Smaller than any message: each gradient takes a bucket of its own (two rounds of
# exchanges and two all-gathers per step, the control words on the last).
BUCKET_BYTES = 4


def gradients(rank, step):
    rng = np.random.RandomState(1000 * step + rank)
    return [rng.randn(*shape).astype(np.float32) for shape in SHAPES]


def main():
    run(sys.argv[1])


def run(out_dir):
    """Everything above, on a strategy of its own, into ``out_dir`` (made if missing);
    returns the strategy."""
    import tensorflow as tf

    import tfgc
    from brief_fit import brief_fit
    from fixed_reduce import make_reduce
    from tfgc.apps.train import worker_info

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        compressor=SPECS[0], communication="reduce_scatter",
        policy=tfgc.CompressionPolicy(min_elements=0), bucket_bytes=BUCKET_BYTES)
    rank, n = worker_info(strategy)
    os.makedirs(out_dir, exist_ok=True)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]

    arrays, stats = {}, {}
    for j, spec in enumerate(SPECS):
        strategy.compressor = spec
        owner = tf.Module()
        reduce = make_reduce(strategy, variables, owner)

        strategy.compression_stats()  # read before, so the figures below are this run's
        for step in range(STEPS):
            for k, r in enumerate(reduce(gradients(rank, step))):
                arrays[f"{j}_out{step}_{k}"] = r
        state = strategy.compression_state(owner)
        if spec == "onebit":
            # A step with a NaN on the last worker: every output NaN, state untouched.
            before = [v.numpy() for v in state.variables()]
            grads = gradients(rank, STEPS)
            if rank == n - 1:
                grads[0][3, 4] = np.nan
            outs = reduce(grads)
            arrays["nan_outputs_all_nan"] = np.array(bool(np.isnan(outs[0]).all()
                                                          and np.isnan(outs[1]).all()))
            arrays["nan_dense_finite"] = np.array(bool(np.isfinite(outs[2]).all()))
            arrays["nan_state_kept"] = np.array(all(
                np.array_equal(a, v.numpy()) for a, v in zip(before, state.variables())))
        for k in range(2):
            for field, var in state.slot(variables[k], 0).items():
                if field != "inner":
                    arrays[f"{j}_{field}{k}"] = var.numpy()
        stats[spec] = strategy.compression_stats()
    np.savez(os.path.join(out_dir, f"reduce.w{rank}.npz"), **arrays)

    strategy.compressor = "onebit"
    losses = brief_fit(strategy, rank, n, out_dir, steps_per_epoch=15)
    with open(os.path.join(out_dir, f"results.w{rank}.json"), "w") as f:
        json.dump({"workers": n, "stats": stats, "losses": losses}, f)
    return strategy


if __name__ == "__main__":
    main()
