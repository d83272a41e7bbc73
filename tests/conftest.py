"""Shared fixtures."""

import os

import pytest

from tfgc.ops import _loader


@pytest.fixture(params=["custom", "reference"])
def mode(request, monkeypatch):
    """Runs a test through the compiled kernels ("custom") and the pure-TF references."""
    if request.param == "custom":
        monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "0")
        if not os.path.exists(_loader.library_path()):
            pytest.skip(f"custom op library {_loader.library_path()} is not built "
                        "(run `python setup.py build_ext --inplace`)")
        # Built but not loadable is a failure, not a skip.
        assert _loader.custom_ops_available(), "custom op library failed to load"
    else:
        monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "1")
        assert not _loader.custom_ops_available()
    return request.param

