"""A cluster worker for the collectives' own paths, one cluster per size for two test
modules:

    paths.py OUT_DIR

runs reduce_scatter.py (the quantized reduce-scatter, into OUT_DIR/reduce_scatter)
and then sparse_paths.py (top-k's shared index and sparse all-reduce, into
OUT_DIR/<path>) in the same processes, on a second strategy: a notebook that tries
another setting does the same. (The second strategy's pairwise exchanges once took
the first one's group keys, and it enabled collective ops a second time; on 3 workers
its first exchange never completed.) OUT_DIR/server.w<rank>.json says whether the
second strategy kept the process's server, as it should.
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


def main():
    import reduce_scatter
    import sparse_paths

    from tensorflow.python.eager import context

    out_dir = sys.argv[1]
    reduce_scatter.run(os.path.join(out_dir, "reduce_scatter"))
    served = context.context()._collective_ops_server_def  # pylint: disable=protected-access
    sparse_paths.run(out_dir, SPARSE)
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(os.path.join(out_dir, f"server.w{rank}.json"), "w") as f:
        json.dump({"first_server": served is not None,
                   "kept": context.context()._collective_ops_server_def is served}, f)  # pylint: disable=protected-access


if __name__ == "__main__":
    main()
