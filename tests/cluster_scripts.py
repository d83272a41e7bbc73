"""What the tests share: the repository, the workers' environment, the cluster scripts,
the benchmark scripts as modules."""

import importlib.util
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "TF_CPP_MIN_LOG_LEVEL": "2"}


def _load(path, module_name):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cluster_script(name):
    """``(path, module)`` of ``tests/cluster/<name>.py``; the module gives its constants."""
    path = os.path.join(REPO, "tests", "cluster", f"{name}.py")
    return path, _load(path, f"cluster_{name}")


def run_cluster(tmp_path_factory, name, script, num_workers=2, args=(), timeout=900,
                env=None):
    """Runs ``script`` (with OUT_DIR and ``args``) on a local cluster of ``num_workers``
    real workers, its output discarded; asserts every worker succeeded and returns
    OUT_DIR, a fresh directory named after ``name``."""
    from tfgc.apps.launch import launch

    out = tmp_path_factory.mktemp(name)
    result = launch([sys.executable, script, str(out)] + [str(a) for a in args], num_workers,
                    env={**ENV, **(env or {})}, timeout=timeout, output=open(os.devnull, "w"))
    assert result.ok, result.message
    return out


_PATHS_RUNS = {}


def paths_cluster(tmp_path_factory, num_workers):
    """OUT_DIR of ``tests/cluster/paths.py`` on ``num_workers`` workers: the reduce-scatter's
    and the sparse paths' runs. Started once per size and process, for the two modules
    that read it (tests/conftest.py gives both to the same pytest-xdist worker)."""
    if num_workers not in _PATHS_RUNS:
        _PATHS_RUNS[num_workers] = run_cluster(
            tmp_path_factory, f"paths{num_workers}",
            os.path.join(REPO, "tests", "cluster", "paths.py"), num_workers, timeout=900)
    return _PATHS_RUNS[num_workers]


def benchmark_module(name):
    """``benchmarks/<name>.py`` as a module (its driver functions, no run)."""
    return _load(os.path.join(REPO, "benchmarks", f"{name}.py"), f"tfgc_benchmarks_{name}")


def assert_fit_identical_and_learning(out, num_workers):
    """After ``brief_fit``: every worker's weights equal worker 0's, and the loss went down.

    Returns worker 0's results JSON.
    """
    first = np.load(out / "fit.w0.npz")
    for r in range(1, num_workers):
        other = np.load(out / f"fit.w{r}.npz")
        for key in first.files:
            np.testing.assert_array_equal(first[key], other[key])
    with open(out / "results.w0.json") as f:
        results = json.load(f)
    assert results["losses"][-1] < results["losses"][0]
    return results
