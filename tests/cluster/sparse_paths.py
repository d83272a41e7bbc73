"""A cluster worker for the sparse communication paths of top-k.

    sparse_paths.py OUT_DIR COMMUNICATION...    shared_index, sparse_allreduce

For each path in turn, on one strategy (its communication switched between them, a
fresh owner each time), and into OUT_DIR/<path>/: reduces deterministic per-worker
"gradients" (a [16, 32] matrix, compressed with ef+topk k=6, and a [40] vector,
dense) for STEPS steps and writes every step's result, this worker's final residual
and the byte figures; the test replays the algorithm in NumPy. On the shared-index
path, importance-weighted pruning (``importance:k=6``) runs the same way with fixed
weights. Then trains the MLP for a few steps the same way and saves its weights.
"""

import json
import os
import sys

import numpy as np

STEPS = 6
K = 6
# A second phase with k over half the tensor: the sparse all-reduce turns dense.
DENSE_K, DENSE_STEPS = 300, 2


def importance_weights():
    w = np.random.RandomState(7).randn(16, 32).astype(np.float32)
    w[0, :4] = 0.0  # the guard's case
    return w


def gradients(rank, step):
    rng = np.random.RandomState(1000 * step + rank)
    return rng.randn(16, 32).astype(np.float32), rng.randn(40).astype(np.float32)


def main():
    run(sys.argv[1], sys.argv[2:])


def run(out_dir, paths, strategy=None):
    """Everything above, into ``out_dir``/<path>/, on a strategy of its own or on
    ``strategy`` (one whose policy compresses every gradient, as ours does), its
    settings made ours."""
    import tensorflow as tf

    import tfgc
    from tfgc.apps.train import worker_info
    from tfgc.distribute.cross_device_ops import DEFAULT_BUCKET_BYTES

    if strategy is None:
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
            compressor=f"ef+topk:k={K}", communication=paths[0],
            policy=tfgc.CompressionPolicy(min_elements=0))
    else:
        assert strategy.cross_device_ops.policy.min_elements == 0
        strategy.cross_device_ops.communication = "auto"  # whatever the compressor was
        strategy.compressor = f"ef+topk:k={K}"
        strategy.bucket_bytes = DEFAULT_BUCKET_BYTES
    rank, n = worker_info(strategy)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros([16, 32])), tf.Variable(tf.zeros([40]))]
    for communication in paths:
        path_dir = os.path.join(out_dir, communication)
        os.makedirs(path_dir, exist_ok=True)
        strategy.compressor = f"ef+topk:k={K}"
        strategy.cross_device_ops.communication = communication
        variables[0].assign(tf.zeros([16, 32]))  # (importance's weights were set here)
        run_path(strategy, variables, communication, rank, n, path_dir)


def run_path(strategy, variables, communication, rank, n, out_dir):
    """One path's reductions, dense phase, importance phase and fit, into ``out_dir``."""
    import tensorflow as tf

    from brief_fit import brief_fit
    from fixed_reduce import make_reduce

    strategy.compression_stats()  # read before, so the figures below are this path's
    owner = tf.Module()
    reduce = make_reduce(strategy, variables, owner)

    outputs = [reduce(gradients(rank, step)) for step in range(STEPS)]
    state = strategy.compression_state(owner)
    residual = [v.numpy() for v in state.variables()][1]
    arrays = {f"out{s}_{j}": o for s, outs in enumerate(outputs) for j, o in enumerate(outs)}
    arrays["residual"] = residual
    stats = strategy.compression_stats()

    strategy.compressor = f"ef+topk:k={DENSE_K}"
    # A fresh owner: this phase's state (and step counter) starts from zero.
    reduce_dense = make_reduce(strategy, variables, tf.Module())

    for step in range(DENSE_STEPS):
        arrays[f"dense{step}"] = reduce_dense(gradients(rank, 100 + step))[0]
    if communication == "shared_index":
        # Importance-weighted pruning: the root ranks by |v| / (|w| + eps), with the
        # weights set to IMPORTANCE_WEIGHTS (auto's path for it is this one).
        strategy.compressor = f"importance:k={K}"
        variables[0].assign(importance_weights())
        importance_owner = tf.Module()
        reduce_importance = make_reduce(strategy, variables, importance_owner)
        for step in range(STEPS):
            arrays[f"imp{step}"] = reduce_importance(gradients(rank, 200 + step))[0]
        state = strategy.compression_state(importance_owner)
        arrays["imp_residual"] = state.slot(variables[0], 0)["residual"].numpy()
    np.savez(os.path.join(out_dir, f"reduce.w{rank}.npz"), **arrays)

    strategy.compressor = "ef+topk:ratio=0.01"
    losses = brief_fit(strategy, rank, n, out_dir, steps_per_epoch=20)
    fit_stats = strategy.compression_stats()
    with open(os.path.join(out_dir, f"results.w{rank}.json"), "w") as f:
        json.dump({"workers": n, "stats": stats, "fit_stats": fit_stats, "losses": losses}, f)


if __name__ == "__main__":
    main()
