"""A cluster worker for the collectives' own paths, one cluster per size for two test
modules:

    paths.py OUT_DIR

fits a small model on TensorFlow's stock MultiWorkerMirroredStrategy first (a user
comparing the two in one process), then runs reduce_scatter.py (the quantized
reduce-scatter, into OUT_DIR/reduce_scatter) and sparse_paths.py (top-k's shared index
and sparse all-reduce, into OUT_DIR/<path>) in the same processes, each on a tfgc
strategy of its own: a notebook that tries another setting does the same. (tfgc's first
strategy once took the stock one's collective keys, a second one the first one's pair
group keys, and each enabled collective ops again; on 3 workers a second strategy's
first exchange never completed.) OUT_DIR/server.w<rank>.json says whether tfgc's
strategies kept the server the stock one started, as they should.
Each cluster's workers spent 7-8 s of CPU starting (TensorFlow's import, the cluster's
connection) before any of their work; tests/test_reduce_scatter.py and
tests/test_sparse_paths.py share one cluster of each size
(``cluster_scripts.paths_cluster``).
"""

import json
import os
import sys

# What the sparse paths run: every path of top-k's.
SPARSE = ("shared_index", "sparse_allreduce")


def stock_fit(out_dir, rank):
    """A few steps of a small model on TensorFlow's own MultiWorkerMirroredStrategy, as a
    user comparing it with tfgc's in one process does first; its weights go to
    OUT_DIR/stock.w<rank>.npz."""
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        net = keras.Sequential([keras.layers.Dense(16, activation="relu", input_shape=(8,)),
                                keras.layers.Dense(3)])
        net.compile(optimizer=keras.optimizers.SGD(0.1),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(rank)
    net.fit(rng.normal(size=(64, 8)).astype(np.float32), rng.integers(0, 3, 64), batch_size=8,
            epochs=1, steps_per_epoch=3, verbose=0)
    np.savez(os.path.join(out_dir, f"stock.w{rank}.npz"), *[w.numpy() for w in net.weights])


def main():
    import reduce_scatter
    import sparse_paths

    from tensorflow.python.eager import context

    out_dir = sys.argv[1]
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    stock_fit(out_dir, rank)
    served = context.context()._collective_ops_server_def  # pylint: disable=protected-access
    reduce_scatter.run(os.path.join(out_dir, "reduce_scatter"))
    sparse_paths.run(out_dir, SPARSE)
    with open(os.path.join(out_dir, f"server.w{rank}.json"), "w") as f:
        json.dump({"first_server": served is not None,
                   "kept": context.context()._collective_ops_server_def is served}, f)  # pylint: disable=protected-access


if __name__ == "__main__":
    main()
