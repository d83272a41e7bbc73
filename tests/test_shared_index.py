"""The shared-index all-reduce on real 2-, 3- and 4-worker clusters, against a NumPy
replay of the algorithm (Cheng & Xu 2019 with top-k selection, error feedback).

One launch per cluster size runs ``tests/cluster/shared_index.py``.
"""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from tfgc.launch import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "cluster", "shared_index.py")
ENV = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "TF_CPP_MIN_LOG_LEVEL": "2"}

_spec = importlib.util.spec_from_file_location("shared_index_worker", SCRIPT)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def replay(n):
    """Per step: the reduced outputs; at the end: every worker's residual."""
    residuals = [np.zeros((16, 32), np.float32) for _ in range(n)]
    outputs = []
    for step in range(worker.STEPS):
        grads = [worker.gradients(r, step) for r in range(n)]
        v = [(residuals[r] + grads[r][0]).ravel() for r in range(n)]
        root = step % n
        # Exact top-k of |v| on the root, ties to the lower index.
        order = np.lexsort((np.arange(v[root].size), -np.abs(v[root])))
        idx = np.sort(order[:worker.K])
        summed = np.zeros(16 * 32, np.float64)
        summed[idx] = sum(v[r][idx].astype(np.float64) for r in range(n))
        dense = sum(grads[r][1].astype(np.float64) for r in range(n))
        outputs.append((summed.reshape(16, 32), dense, idx))
        for r in range(n):
            kept = v[r].copy()
            kept[idx] = 0
            residuals[r] = kept.reshape(16, 32)
    return outputs, residuals


@pytest.fixture(scope="module", params=[2, 3, 4])
def cluster(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"shared_index{n}")
    result = launch([sys.executable, SCRIPT, str(out)], n, env=ENV, timeout=600,
                    output=open(os.devnull, "w"))
    assert result.ok, result.message
    return n, out


def test_matches_numpy_replay_and_workers_agree(cluster):
    n, out = cluster
    expected, residuals = replay(n)
    runs = [np.load(out / f"reduce.w{r}.npz") for r in range(n)]
    for step, (summed, dense, idx) in enumerate(expected):
        got = runs[0][f"out{step}_0"]
        # Non-zeros exactly at the root's top-k indices...
        assert sorted(np.flatnonzero(got)) == sorted(idx), step
        # ...holding the sum of every worker's v there (summed over the ring).
        np.testing.assert_allclose(got, summed, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(runs[0][f"out{step}_1"], dense, rtol=1e-6, atol=1e-6)
        for r in range(1, n):
            np.testing.assert_array_equal(runs[r][f"out{step}_0"], got)
            np.testing.assert_array_equal(runs[r][f"out{step}_1"], runs[0][f"out{step}_1"])
    for r in range(n):
        # Each worker keeps what it did not send, bit for bit.
        np.testing.assert_array_equal(runs[r]["residual"], residuals[r])


def test_error_feedback_conserves_mass(cluster):
    n, out = cluster
    run = np.load(out / "reduce.w0.npz")
    applied = sum(run[f"out{s}_0"].astype(np.float64) for s in range(worker.STEPS))
    left = sum(np.load(out / f"reduce.w{r}.npz")["residual"].astype(np.float64)
               for r in range(n))
    total = sum(worker.gradients(r, s)[0].astype(np.float64)
                for s in range(worker.STEPS) for r in range(n))
    np.testing.assert_allclose(applied + left, total, rtol=1e-5, atol=1e-5)


def test_bytes_stay_flat_and_below_dense(cluster):
    n, out = cluster
    with open(out / "results.w0.json") as f:
        stats = json.load(f)["stats"]
    ring = lambda b: 2 * (n - 1) * b // n  # noqa: E731
    # k int32 indices + 9 control words, then k values + the dense [40] vector.
    payload = 4 * worker.K + 36 + 4 * worker.K + 4 * 40
    assert stats["payload_bytes"] == payload
    assert stats["sent_bytes"] == ring(payload)
    assert stats["sent_bytes"] < stats["dense_sent_bytes"] == ring(4 * (16 * 32 + 40))


def test_fit_ends_identical_on_every_worker(cluster):
    n, out = cluster
    first = np.load(out / "fit.w0.npz")
    for r in range(1, n):
        other = np.load(out / f"fit.w{r}.npz")
        for key in first.files:
            np.testing.assert_array_equal(first[key], other[key])
    with open(out / "results.w0.json") as f:
        results = json.load(f)
    assert results["fit_stats"]["steps"] - results["stats"]["steps"] == 40
    assert results["losses"][-1] < results["losses"][0]


@pytest.mark.parametrize("spec", ["qsgd", "onebit", "randomk", "none"])
def test_refused_for_compressors_that_do_not_select_indices(spec):
    from tfgc.distribute.cross_device_ops import check_compression_args
    with pytest.raises(ValueError, match="`communication`='shared_index'"):
        check_compression_args(spec, None, "shared_index", 1 << 20)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "ef+topk:ratio=0.001"])
def test_accepted_for_top_k(spec):
    from tfgc.distribute.cross_device_ops import check_compression_args
    compressor, _ = check_compression_args(spec, None, "shared_index", 1 << 20)
    assert compressor.selects_indices
