"""Shared fixtures."""

import os

import pytest

from tfgc.ops import _loader

# Every process of the suite (its workers inherit this) times auto's candidates afresh,
# as a first job on a machine does: timings an earlier run kept on disk
# (``planner.CPU_CACHE_ENV``) must not decide a test's plan. The cache's own test turns
# it on, in a directory of its own.
os.environ.setdefault("TFGC_AUTO_CPU_CACHE", "0")


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

