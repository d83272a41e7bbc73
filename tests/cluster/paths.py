"""A cluster worker for the collectives' own paths, one cluster per size for two test
modules:

    paths.py OUT_DIR

runs reduce_scatter.py (the quantized reduce-scatter, into OUT_DIR/reduce_scatter)
and then sparse_paths.py (top-k's shared index and sparse all-reduce, into
OUT_DIR/<path>) on the same strategy, its compressor, path and bucket size switched as
a user switches them. Each cluster's workers spent 7-8 s of CPU starting (TensorFlow's
import, the cluster's connection) before any of their work; tests/test_reduce_scatter.py
and tests/test_sparse_paths.py now share one cluster of each size
(``cluster_scripts.paths_cluster``). (A second strategy in the same processes, on 3
workers, hung in its first collective.)
"""

import os
import sys

# What the sparse paths run: every path of top-k's.
SPARSE = ("shared_index", "sparse_allreduce")


def main():
    import reduce_scatter
    import sparse_paths

    out_dir = sys.argv[1]
    strategy = reduce_scatter.run(os.path.join(out_dir, "reduce_scatter"))
    sparse_paths.run(out_dir, SPARSE, strategy)


if __name__ == "__main__":
    main()
