"""Shared fixtures."""

import atexit
import os
import shutil
import tempfile

import pytest

from tfgc.ops import _loader

# auto's CPU timings (``planner.CPU_CACHE_ENV``) go to a file of this run's own: timings
# an earlier run kept on disk must not decide a test's plan, and the first process that
# times the candidates spares the later ones (each cluster's workers timed them afresh,
# 10-15 s of CPU each). The process that loads this first (pytest, or pytest-xdist's
# controller) makes the file's directory; its workers and their clusters inherit it. The
# cache's own test gives it a directory of its own.
if "TFGC_AUTO_CPU_CACHE" not in os.environ:
    _timings = tempfile.mkdtemp(prefix="tfgc-tests-")
    os.environ["TFGC_AUTO_CPU_CACHE"] = os.path.join(_timings, "cpu.json")
    atexit.register(shutil.rmtree, _timings, True)


@pytest.fixture(params=["custom", "reference"])
def mode(request, monkeypatch):
    """Runs a test through the compiled kernels ("custom") and the pure-TF references."""
    if request.param == "custom":
        monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "0")
        built = os.path.exists(_loader.library_path())
        # Loads the installed or cached library, compiling it into the cache
        # first when neither exists.
        available = _loader.custom_ops_available()
        if not built and not available:
            pytest.skip("no custom op library could be built or loaded "
                        f"(run `{_loader.BUILD_COMMAND}` to see why)")
        # Built but not loadable is a failure, not a skip.
        assert available, f"custom op library {_loader.library_path()} failed to load"
    else:
        monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "1")
        assert not _loader.custom_ops_available()
    return request.param


# The modules that start multi-worker clusters or install the package, longest first
# (a suite's durations on a 2-core machine, in seconds: user_models 314, distributed 363,
# reduce_scatter 109, install 96, keras3 92, sparse_paths 80, overlap 77, auto 74,
# state 68; every other module under 40). scripts/test.sh runs the suite on two
# pytest-xdist workers, a module to a worker (--dist loadfile, its clusters shared by its
# tests), handed out in collection order: longest first, the two workers finish
# together instead of one running the longest module alone at the end.
LONGEST_FIRST = ("test_user_models", "test_distributed", "test_reduce_scatter",
                 "test_sparse_paths", "test_install", "test_keras3", "test_overlap",
                 "test_auto", "test_state")
# Modules that read the same clusters (``cluster_scripts.paths_cluster``), each given to
# the worker of the first: module -> the module whose worker runs it.
SHARED_CLUSTERS = {"test_sparse_paths": "test_reduce_scatter"}


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.stem
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: each module's tests keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``: a module to a worker, as xdist's own, but the modules of
    ``SHARED_CLUSTERS`` to the worker of the module they share clusters with."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # pylint: disable=import-outside-toplevel

    class SharedClusterScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]  # loadfile's scope: the module's file
            name = path.rpartition("/")[2]
            owner = SHARED_CLUSTERS.get(name[:-len(".py")])
            return path if owner is None else path[:-len(name)] + owner + ".py"

    return SharedClusterScheduling(config, log)
