"""Top-k's sparse communication paths on real 2-, 3- and 4-worker clusters, against a
NumPy replay of each algorithm (error feedback included):

* ``shared_index``: one root's index set, in rotation, serves every worker (Cheng &
  Xu 2019, with top-k selection);
* ``sparse_allreduce``: every worker's own top-k set, merged by recursive doubling
  with a dense switch (SparCML).

One launch per cluster size runs ``tests/cluster/sparse_paths.py`` on both paths, in the
processes that ran a stock strategy's fit and the reduce-scatter's checks first
(``tests/cluster/paths.py``), on a strategy of its own: every test of a cluster below
also checks that a later strategy in the same processes reduces as the first did.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from cluster_scripts import assert_fit_identical_and_learning, cluster_script, paths_cluster

_, worker = cluster_script("sparse_paths")


def top_k(v, k):
    """Exact top-k of |v|, ties to the lower index, ascending."""
    order = np.lexsort((np.arange(v.size), -np.abs(v)))
    return np.sort(order[:k])


def replay(n, path, k=worker.K, steps=worker.STEPS, first_step=0, weights=None):
    """Per step: the reduced outputs; at the end: every worker's residual. With
    ``weights``, the root ranks by importance |v| / (|w| + 1e-6) instead of |v|."""
    residuals = [np.zeros((16, 32), np.float32) for _ in range(n)]
    outputs = []
    for step in range(first_step, first_step + steps):
        grads = [worker.gradients(r, step) for r in range(n)]
        v = [(residuals[r] + grads[r][0]).ravel() for r in range(n)]
        if path == "shared_index":
            root = v[(step - first_step) % n]  # the root, in rotation
            if weights is not None:
                root = np.abs(root) / (np.abs(weights.ravel()) + np.float32(1e-6))
            shared = top_k(root, k)
            chosen = [shared] * n
        else:
            chosen = [top_k(v[r], k) for r in range(n)]
        summed = np.zeros(16 * 32, np.float64)
        for r in range(n):
            summed[chosen[r]] += v[r][chosen[r]]
        dense = sum(grads[r][1].astype(np.float64) for r in range(n))
        support = np.unique(np.concatenate(chosen))
        outputs.append((summed.reshape(16, 32), dense, support, chosen))
        for r in range(n):
            kept = v[r].copy()
            kept[chosen[r]] = 0
            residuals[r] = kept.reshape(16, 32)
    return outputs, residuals


NAMES = cluster_script("paths")[1].SPARSE
PATHS = [(path, n) for n in (2, 3, 4) for path in NAMES]


@pytest.fixture(scope="module", params=PATHS, ids=[f"{p}-{n}" for p, n in PATHS])
def cluster(request, tmp_path_factory):
    path, n = request.param
    # One cluster per size runs both paths (and the reduce-scatter's module).
    return path, n, paths_cluster(tmp_path_factory, n) / path


def test_matches_numpy_replay_and_workers_agree(cluster):
    path, n, out = cluster
    expected, residuals = replay(n, path)
    runs = [np.load(out / f"reduce.w{r}.npz") for r in range(n)]
    for step, (summed, dense, idx, _) in enumerate(expected):
        got = runs[0][f"out{step}_0"]
        # Non-zeros exactly at the sent indices (the root's, or every worker's)...
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


def sparse_sent_bytes(sets, n, length):
    """Bytes each rank sends in the sparse all-reduce, from the ranks' index sets.

    A stage sends a 4-byte count and then the larger of the two sets as 8-byte
    pairs, or the dense vector once the two together cover half the space; each
    exchange adds a 4-byte rank tag.
    """
    power = 1 << (n.bit_length() - 1)
    cur = [set(int(i) for i in s) for s in sets]
    size = [len(c) for c in cur]
    sent = [0] * n

    def stage(a, b):
        if 2 * (size[a] + size[b]) >= length:
            cost, merged, count = 4 * length, set(range(length)), length
        else:
            cost, merged = 8 * max(size[a], size[b]), cur[a] | cur[b]
            count = len(merged)
        for r in (a, b):
            sent[r] += 12 + cost
            cur[r], size[r] = merged, count

    for r in range(power, n):
        stage(r - power, r)
    distance = 1
    while distance < power:
        for a in range(power):
            if a < a ^ distance:
                stage(a, a ^ distance)
        distance *= 2
    for r in range(power, n):
        cur[r], size[r] = set(), 0
        stage(r - power, r)
    return sent


def test_dense_switch_keeps_the_sum_exact(cluster):
    path, n, out = cluster
    expected, _ = replay(n, path, k=worker.DENSE_K, steps=worker.DENSE_STEPS, first_step=100)
    runs = [np.load(out / f"reduce.w{r}.npz") for r in range(n)]
    for step, (summed, _, _, _) in enumerate(expected):
        np.testing.assert_allclose(runs[0][f"dense{step}"], summed, rtol=1e-6, atol=1e-6)
        for r in range(1, n):
            np.testing.assert_array_equal(runs[r][f"dense{step}"], runs[0][f"dense{step}"])


def test_error_feedback_conserves_mass(cluster):
    path, n, out = cluster
    run = np.load(out / "reduce.w0.npz")
    applied = sum(run[f"out{s}_0"].astype(np.float64) for s in range(worker.STEPS))
    left = sum(np.load(out / f"reduce.w{r}.npz")["residual"].astype(np.float64)
               for r in range(n))
    total = sum(worker.gradients(r, s)[0].astype(np.float64)
                for s in range(worker.STEPS) for r in range(n))
    np.testing.assert_allclose(applied + left, total, rtol=1e-5, atol=1e-5)


def test_bytes_below_dense(cluster):
    path, n, out = cluster
    ring = lambda b: 2 * (n - 1) * b // n  # noqa: E731
    dense_ring = ring(4 * (16 * 32 + 40))
    # k indices and k values, 9 control words, the dense [40] vector.
    payload = 8 * worker.K + 36 + 4 * 40
    for r in range(n):
        with open(out / f"results.w{r}.json") as f:
            stats = json.load(f)["stats"]
        assert stats["payload_bytes"] == payload
        assert stats["dense_sent_bytes"] == dense_ring
        if path == "shared_index":
            # Everything goes through ring all-reduces: flat in N.
            assert stats["sent_bytes"] == ring(payload)
        else:
            # The control words and the dense vector take ring all-reduces; the
            # top-k sets the pairwise stages, which depend on the sets' overlap.
            sets = replay(n, path)[0][-1][3]
            stages = sparse_sent_bytes(sets, n, 16 * 32)[r]
            assert stats["sent_bytes"] == ring(36) + ring(4 * 40) + stages
        assert stats["sent_bytes"] < dense_ring


def test_fit_ends_identical_on_every_worker(cluster):
    path, n, out = cluster
    results = assert_fit_identical_and_learning(out, n)
    # The fit's 40 steps, the dense phase and, on the shared index, importance's steps.
    extra = worker.STEPS if path == "shared_index" else 0
    assert results["fit_stats"]["steps"] - results["stats"]["steps"] == \
        40 + worker.DENSE_STEPS + extra


def test_strategies_after_a_stock_one_keep_its_server(cluster):
    # A stock MultiWorkerMirroredStrategy trained first in these processes (every worker
    # ends with its weights), then a tfgc strategy (the reduce-scatter's), then a second
    # one (the sparse paths'): both found collective ops enabled for their cluster and
    # task and kept that server (enabling them again reset the runtime under the earlier
    # strategies' collectives), and took collective keys apart from the stock one's.
    path, n, out = cluster
    stock = [np.load(out.parent / f"stock.w{r}.npz") for r in range(n)]
    for r in range(n):
        for key in stock[0].files:
            assert np.all(np.isfinite(stock[r][key]))
            np.testing.assert_array_equal(stock[r][key], stock[0][key])
        with open(out.parent / f"server.w{r}.json") as f:
            assert json.load(f) == {"first_server": True, "kept": True}, (path, r)


def test_each_strategy_of_a_process_has_pair_group_keys_of_its_own():
    # The sparse all-reduce's pairwise exchanges (recursive doubling): a second strategy
    # whose pairs took the first one's group keys met the first one's instances in the
    # runtime (a shape mismatch, or on 3 workers an exchange that never completed).
    from tfgc.collectives import pairwise

    options = tf.distribute.experimental.CommunicationOptions()
    keys = {}
    for index in range(3):
        for a in range(4):
            for b in range(a + 1, 4):
                exchanger = pairwise.PairExchanger(a, 4, "/cpu:0", options, keys_index=index)
                key = exchanger._keys.pair_group_key(a, b, 4, "/cpu:0", index)  # pylint: disable=protected-access
                assert key not in keys.values(), (index, a, b)
                keys[(index, a, b)] = key
    # Both members of a pair name it alike.
    assert all(keys[(i, a, b)] == pairwise._PairKeys().pair_group_key(b, a, 4, "/cpu:0", i)  # pylint: disable=protected-access
               for (i, a, b) in keys)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="keys_index"):
            pairwise.PairExchanger(0, 4, "/cpu:0", options, keys_index=bad)
    with pytest.raises(ValueError, match="int32"):
        pairwise.PairExchanger(0, 1024, "/cpu:0", options, keys_index=3000)


@pytest.mark.parametrize("spec", ["qsgd", "onebit", "randomk", "none"])
@pytest.mark.parametrize("path", ["shared_index", "sparse_allreduce"])
def test_refused_for_compressors_that_are_not_top_k(spec, path):
    from tfgc.distribute.cross_device_ops import check_compression_args
    with pytest.raises(ValueError, match=f"`communication`='{path}'"):
        check_compression_args(spec, None, path, 1 << 20)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "ef+topk:ratio=0.001"])
@pytest.mark.parametrize("path", ["shared_index", "sparse_allreduce"])
def test_accepted_for_top_k(spec, path):
    from tfgc.distribute.cross_device_ops import check_compression_args
    compressor, _ = check_compression_args(spec, None, path, 1 << 20)
    assert compressor.index_selection is not None and compressor.sparse_entries is not None


def test_importance_pruning_on_the_shared_index(cluster):
    """Cheng & Xu's importance |v| / |w| picks the root's indices; every worker sums its
    values there and keeps the rest: as the NumPy replay, on every worker."""
    path, n, out = cluster
    if path != "shared_index":
        pytest.skip("importance-weighted pruning runs on the shared-index path")
    weights = worker.importance_weights()
    expected, residuals = replay(n, path, first_step=200, weights=weights)
    plain, _ = replay(n, path, first_step=200)
    runs = [np.load(out / f"reduce.w{r}.npz") for r in range(n)]
    differs = False
    for step, (summed, _, _, chosen) in enumerate(expected):
        np.testing.assert_allclose(runs[0][f"imp{step}"], summed, rtol=1e-5, atol=1e-5)
        for r in range(1, n):
            np.testing.assert_array_equal(runs[r][f"imp{step}"], runs[0][f"imp{step}"])
        differs |= not np.array_equal(chosen[0], plain[step][3][0])
    assert differs, "importance chose what plain top-k chooses: the weights were not read"
    for r in range(n):
        np.testing.assert_allclose(runs[r]["imp_residual"], residuals[r], rtol=1e-5, atol=1e-5)
