"""A cluster worker for the buckets (overlap of communication with back-propagation).

    overlap.py OUT_DIR

For every (compressor, communication) of ``SPECS``, reduces the same per-worker
"gradients" of a small stack of layers (``SHAPES``: kernels compressed, biases dense)
for ``STEPS`` steps twice, over fresh variables each time: once with every compressed
kernel in a bucket of its own (``overlap_bytes=1``) and once in one bucket
(``overlap_bytes=0``). Writes each run's outputs and final compressor state to
OUT_DIR/<i>.<mode>.w<rank>.npz.

For ``PIECE_SPECS`` (the reduce-scatter), reduces ``PIECE_SHAPES``, whose first kernel
is larger than ``MIN_PIECE_BYTES``, with pieces (``overlap_bytes=1``) and whole
(``overlap_bytes=0``) to OUT_DIR/piece<i>.<mode>.w<rank>.npz.

Then, for ``NONFINITE_SPECS``, with one bucket per kernel: at step ``BAD_STEP`` the
last worker's first kernel (the last bucket to be reduced) holds a NaN; the state
before and after that step, the outputs and the step counter are written to
OUT_DIR/nonfinite<i>.w<rank>.npz, and one more good step follows.
"""

import json
import os
import sys

import numpy as np

# A stack of layers, first to last: kernels (compressed) and biases (dense).
SHAPES = [(64, 48), (48,), (48, 40), (40,), (40, 30), (30,), (30, 24), (24,)]
STEPS = 4
SPECS = [
    ("onebit", "reduce_scatter"),
    ("qsgd:levels=7,bucket_size=32", "reduce_scatter"),
    ("qsgd:levels=7,bucket_size=32", "allgather"),
    ("terngrad", "reduce_scatter"),
    ("signsgd", "reduce_scatter"),
    ("ef+topk:ratio=0.1", "allgather"),
    ("ef+topk:ratio=0.1", "shared_index"),
    ("ef+topk:ratio=0.1", "sparse_allreduce"),
    ("powersgd:rank=2", "low_rank"),
    ("fp16", "allreduce"),
    ("randomk:ratio=0.2", "allreduce"),
    ("dgc:ratio=0.1,warmup_steps=2", "allgather"),
]
# A kernel of 1.5 MiB (2 pieces of at least 1 MiB), a bias, a small kernel and one of
# a single element (fewer than the workers: sent as it is).
PIECE_SHAPES = [(768, 512), (512,), (64, 48), (1, 1)]
PIECE_SPECS = [("signsgd", "reduce_scatter"), ("bf16", "reduce_scatter"),
               ("qsgd:levels=7,bucket_size=32", "reduce_scatter"),
               ("terngrad", "reduce_scatter"), ("efsignsgd", "reduce_scatter")]
NONFINITE_SPECS = [("ef+topk:ratio=0.1", "allgather"), ("onebit", "reduce_scatter"),
                   ("powersgd:rank=2", "low_rank"), ("ef+topk:ratio=0.1", "sparse_allreduce")]
BAD_STEP = 2


def gradients(rank, step, shapes=SHAPES):
    rng = np.random.RandomState(100 * step + rank)
    return [rng.randn(*shape).astype(np.float32) for shape in shapes]


def main():
    out_dir = sys.argv[1]
    import tensorflow as tf

    import tfgc
    from fixed_reduce import make_reduce, use
    from tfgc.apps.train import worker_info

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        policy=tfgc.CompressionPolicy(min_elements=0))
    rank, n = worker_info(strategy)

    def run(spec, communication, overlap_bytes, shapes=SHAPES):
        use(strategy, spec, communication, overlap_bytes)
        with strategy.scope():
            variables = [tf.Variable(tf.zeros(shape), name=f"g{j}")
                         for j, shape in enumerate(shapes)]
        owner = tf.Module()
        return make_reduce(strategy, variables, owner), owner, variables

    def state_of(owner):
        return [v.numpy() for v in strategy.compression_state(owner).variables()]

    for k, (spec, communication) in enumerate(SPECS):
        for mode, overlap_bytes in (("buckets", 1), ("one", 0)):
            reduce, owner, _ = run(spec, communication, overlap_bytes)
            arrays = {}
            for step in range(STEPS):
                for j, r in enumerate(reduce(gradients(rank, step))):
                    arrays[f"out{step}_{j}"] = r
            for j, v in enumerate(state_of(owner)):
                arrays[f"state{j}"] = v
            np.savez(os.path.join(out_dir, f"{k}.{mode}.w{rank}.npz"), **arrays)

    for k, (spec, communication) in enumerate(PIECE_SPECS):
        for mode, overlap_bytes in (("pieces", 1), ("one", 0)):
            reduce, owner, variables = run(spec, communication, overlap_bytes, PIECE_SHAPES)
            arrays = {}
            for step in range(STEPS):
                for j, r in enumerate(reduce(gradients(rank, step, PIECE_SHAPES))):
                    arrays[f"out{step}_{j}"] = r
            for j, v in enumerate(state_of(owner)):
                arrays[f"state{j}"] = v
            slot = strategy.compression_state(owner).slot(variables[0], 0)
            for field, var in slot.items():
                if field != "inner":
                    arrays[f"slot_{field}"] = var.numpy()
            np.savez(os.path.join(out_dir, f"piece{k}.{mode}.w{rank}.npz"), **arrays)
            with open(os.path.join(out_dir, f"piece{k}.{mode}.w{rank}.json"), "w") as f:
                json.dump({"uncompressed": strategy.uncompressed_gradients(),
                           "stats": strategy.compression_stats(),
                           "names": [v.name for v in variables]}, f)

    for k, (spec, communication) in enumerate(NONFINITE_SPECS):
        reduce, owner, _ = run(spec, communication, 1)
        arrays = {}
        skipped = strategy.compression_stats()["nonfinite_steps"]
        for step in range(BAD_STEP):
            reduce(gradients(rank, step))
        arrays.update({f"before{j}": v for j, v in enumerate(state_of(owner))})
        bad = gradients(rank, BAD_STEP)
        if rank == n - 1:
            bad[0][3, 5] = np.nan
        arrays.update({f"bad_out{j}": r for j, r in enumerate(reduce(bad))})
        arrays.update({f"after{j}": v for j, v in enumerate(state_of(owner))})
        skipped = strategy.compression_stats()["nonfinite_steps"] - skipped
        arrays.update({f"next_out{j}": r
                       for j, r in enumerate(reduce(gradients(rank, BAD_STEP + 1)))})
        arrays.update({f"next{j}": v for j, v in enumerate(state_of(owner))})
        np.savez(os.path.join(out_dir, f"nonfinite{k}.w{rank}.npz"), **arrays)
        with open(os.path.join(out_dir, f"nonfinite{k}.w{rank}.json"), "w") as f:
            json.dump({"skipped": skipped}, f)


if __name__ == "__main__":
    main()
