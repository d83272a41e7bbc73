"""Buckets: a step's gradients reduced last layers first, as back-propagation makes them.

* ``plan``: the buckets' order and sizes;
* the traced graph: with buckets, the first collective of every path waits for none
  of the first layer's back-propagation (so it runs while that still computes); in
  one bucket, every collective waits for all of it;
* pieces (the reduce-scatter cuts a gradient larger than ``overlap_bytes``): how a
  chunk is cut, and that each piece has collectives of its own;
* a real 2-worker cluster (``tests/cluster/overlap.py``, one launch): every path gives
  bit for bit the same outputs and state in one bucket per kernel as in one bucket for
  the whole step, workers agree, and a NaN in one worker's last bucket skips the whole
  step: every bucket's outputs NaN, no state written on any worker, training goes on.
  A gradient reduced in pieces gives the bits of the whole gradient under the
  deterministic quantizers, and errs as the whole gradient does under the stochastic.
"""

import json
import re

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc import collectives
from tfgc.distribute import buckets
from tfgc.distribute.paths import reduce_scatter

from cluster_scripts import cluster_script, run_cluster

SCRIPT, worker = cluster_script("overlap")
_, fixed_reduce = cluster_script("fixed_reduce")


def specs(*shapes):
    return [tf.TensorSpec(s, tf.float32) for s in shapes]


# -- the plan ----------------------------------------------------------------------

def test_plan_walks_from_the_last_layer_with_the_dense_tensors_last():
    # kernel 4 KB, bias, kernel 4 KB, bias, kernel 400 B, bias
    t = specs([32, 32], [32], [32, 32], [32], [10, 10], [10])
    mask = [True, False, True, False, True, False]
    # Every kernel its own bucket, last layer first; the biases with the last bucket.
    assert buckets.plan(t, mask, 1) == [[4], [2], [0, 1, 3, 5]]
    assert buckets.plan(t, mask, 400) == [[4], [2], [0, 1, 3, 5]]
    # A bucket closes once it holds overlap_bytes: the last two kernels together.
    assert buckets.plan(t, mask, 4096) == [[2, 4], [0, 1, 3, 5]]
    assert buckets.plan(t, mask, 1 << 30) == [list(range(6))]
    assert buckets.plan(t, mask, 0) == [list(range(6))]


def test_one_compressed_gradient_is_one_bucket():
    t = specs([8], [32, 32], [32], [32, 32], [32])
    assert buckets.plan(t, [False, True, False, False, False], 1) == [list(range(5))]
    assert buckets.plan(t, [False, True, False, True, False], 1) == [[3], [0, 1, 2, 4]]


def test_every_position_is_in_exactly_one_bucket():
    rng = np.random.RandomState(0)
    for _ in range(50):
        count = rng.randint(1, 12)
        t = specs(*[[int(rng.randint(1, 50)), int(rng.randint(1, 50))] for _ in range(count)])
        mask = list(rng.rand(count) < 0.6)
        plan = buckets.plan(t, mask, int(rng.choice([0, 1, 2000, 8000])))
        assert sorted(i for b in plan for i in b) == list(range(count))
        if sum(mask) > 0:
            assert all(any(mask[i] for i in b) for b in plan)
            # Last layers first; each bucket's compressed gradients consecutive.
            runs = [[i for i in b if mask[i]] for b in plan]
            assert [i for r in reversed(runs) for i in r] == [i for i in range(count)
                                                               if mask[i]]
            # Only the last bucket holds dense tensors.
            assert all(mask[i] for b in plan[:-1] for i in b)


def test_overlap_bytes_is_checked_at_construction():
    for bad in (-1, 1.5, True, "4mb"):
        with pytest.raises(ValueError, match="overlap_bytes"):
            tfgc.CompressedMultiWorkerMirroredStrategy(overlap_bytes=bad)


@pytest.mark.parametrize("name, least", [("overlap_bytes", 0), ("bucket_bytes", 1)])
def test_sizes_set_later_are_checked_and_start_a_new_generation(name, least):
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy()
    cdo = strategy.cross_device_ops
    before, generation, settings = getattr(strategy, name), cdo.generation, cdo.settings()
    for bad in (least - 1, 1.5, True, "4mb"):
        with pytest.raises(ValueError, match=name):
            setattr(strategy, name, bad)
    assert getattr(strategy, name) == before and cdo.generation == generation
    setattr(strategy, name, before + 1)
    assert getattr(strategy, name) == getattr(cdo, name) == before + 1
    # Traced steps see a new generation; the workers exchange the new settings.
    assert cdo.generation == generation + 1 and cdo.settings() != settings


# -- pieces ------------------------------------------------------------------------

def _pieces(spec, shape, n, piece_bytes):
    recompression = tfgc.get_compressor(spec).chunk_recompression
    shape = tf.TensorShape(shape)
    plan = collectives.chunk_plan(recompression.chunk_layout(shape, n), shape, n)
    return plan, reduce_scatter.pieces_of(recompression, plan, 4 * shape.num_elements(),
                                          piece_bytes)


def test_pieces_cut_every_chunk_into_parts_that_join_back():
    mib = reduce_scatter.MIN_PIECE_BYTES
    for spec, shape, n in (("qsgd:levels=7,bucket_size=128", (1000, 1100), 3),
                           ("signsgd", (3, 3, 256, 600), 2), ("fp16", (2048, 2048), 4),
                           ("terngrad", (1_000_003,), 4)):
        size = 4 * int(np.prod(shape))
        plan, cuts = _pieces(spec, shape, n, mib)
        count = -(-size // mib)
        assert cuts is not None and len(cuts) == n
        x = tf.reshape(tf.range(int(np.prod(shape)), dtype=tf.float32), shape)
        for c, cut in enumerate(cuts):
            assert len(cut.chunks) == count
            chunk = plan.take(x, c)
            parts = [cut.take(chunk, k) for k in range(count)]
            # Every element of the chunk in exactly one piece, joined back in place.
            assert sum(int(tf.size(p)) for p in parts) == int(tf.size(chunk))
            np.testing.assert_array_equal(cut.join(parts, chunk.shape), chunk)
    # QSGD's pieces fall on whole buckets, as its chunks do.
    _, cuts = _pieces("qsgd:levels=7,bucket_size=128", (1000, 1100), 3, mib)
    assert all(a % 128 == 0 for cut in cuts for a, _, _ in cut.chunks)


def test_pieces_only_for_gradients_larger_than_the_piece_size_and_never_below_a_floor():
    mib = reduce_scatter.MIN_PIECE_BYTES
    # 0: never; a gradient no larger than the piece: whole.
    assert _pieces("signsgd", (2048, 2048), 4, 0)[1] is None
    assert _pieces("signsgd", (512, 512), 4, mib)[1] is None
    # A piece size below the floor is raised to it: 16 MiB -> 16 pieces, not 16 Ki.
    assert len(_pieces("signsgd", (2048, 2048), 4, 1)[1][0].chunks) == 16
    assert len(_pieces("signsgd", (2048, 2048), 4, 4 * mib)[1][0].chunks) == 4
    # 1-bit SGD: never. Its pieces would be column blocks (strided copies) or row
    # blocks (means of their own, so other bits and more of them).
    for shape, n in (((2048, 2048), 4), ((8192, 256), 2), ((256, 8192), 2)):
        assert _pieces("onebit", shape, n, mib)[1] is None, shape
    # 8 MiB in 4 MiB pieces: each owner's chunk in 2.
    assert [len(cut.chunks) for cut in _pieces("terngrad", (2 << 20,), 3, 4 * mib)[1]] == [2] * 3


# -- the traced graph --------------------------------------------------------------

LAYERS = 5
TRACED = [("ef+topk:ratio=0.1", "allgather"), ("fp16", "allreduce"),
          ("onebit", "reduce_scatter"), ("ef+topk:ratio=0.1", "shared_index"),
          ("ef+topk:ratio=0.1", "sparse_allreduce"), ("powersgd:rank=2", "low_rank")]


@pytest.fixture(scope="module")
def traced():
    """``trace(spec, communication, overlap_bytes, width=64)`` -> for each collective of
    one training step, in program order, the layers whose gradients it waits for."""
    import tf_keras as keras
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        policy=tfgc.CompressionPolicy(min_elements=1024))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x = tf.constant(np.random.RandomState(0).rand(16, 32).astype(np.float32))
    y = tf.constant(np.arange(16) % 10)

    def trace(spec, communication, overlap_bytes, width=64):
        fixed_reduce.use(strategy, spec, communication, overlap_bytes)
        with strategy.scope():
            net = keras.Sequential(
                [keras.layers.Dense(width, activation="relu", name=f"d{i}")
                 for i in range(LAYERS - 1)] + [keras.layers.Dense(10, name=f"d{LAYERS - 1}")])
            net.build((None, 32))
            opt = keras.optimizers.SGD(0.01)

        @tf.function
        def step(x, y):
            def replica_fn(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(loss_fn(y, net(x, training=True)))
                grads = tape.gradient(loss, net.trainable_variables)
                opt.apply_gradients(zip(grads, net.trainable_variables))
                return loss
            return strategy.run(replica_fn, args=(x, y))

        graph = step.get_concrete_function(x, y).graph
        found = []
        for op in graph.get_operations():
            if not op.type.startswith("Collective"):
                continue
            seen, stack = set(), [op]
            while stack:
                child = stack.pop()
                for parent in [t.op for t in child.inputs] + list(child.control_inputs):
                    if parent not in seen:
                        seen.add(parent)
                        stack.append(parent)
            layers = {int(m.group(1)) for o in seen
                      for m in [re.search(r"gradient_tape/.*?d(\d)/", o.name)] if m}
            found.append(layers)
        return found

    return trace


@pytest.mark.parametrize("spec,communication", TRACED, ids=[f"{s}@{c}" for s, c in TRACED])
def test_the_first_collective_runs_before_the_first_layer_back_propagates(
        traced, spec, communication):
    bucketed = traced(spec, communication, 1)
    assert bucketed, "no collective traced"
    # Data and control edges: the first collective needs the last layers' gradients,
    # not the first layer's, so it can run while that is computed.
    assert 0 not in bucketed[0], bucketed
    assert max(bucketed[0]) == LAYERS - 1
    # The last layer's collective comes first, the first layer's last.
    assert any(0 in layers for layers in bucketed[1:])
    whole = traced(spec, communication, 0)
    assert all(0 in layers for layers in whole if layers), whole


def test_each_piece_of_a_large_gradient_has_collectives_of_its_own(traced):
    # Hidden layers of 768 x 768: 2.25 MiB kernels, 3 pieces each at 1 MiB.
    found = traced("signsgd", "reduce_scatter", 1, width=768)
    # One worker: no exchanges, one all-gather a message. A message of d3 waits for
    # d3's gradient (and d4's back-propagation), not d2's.
    firsts = [min(layers) for layers in found if layers]
    assert firsts.count(3) == firsts.count(2) == firsts.count(1) == 3, found
    whole = traced("signsgd", "reduce_scatter", 0, width=768)
    assert len(whole) < len(found)


def test_identity_stays_one_bucket_as_the_stock_strategy_packs(traced):
    # "none" is the stock strategy's reduction bit for bit, at any cluster size: its
    # packs follow bytes_per_pack, never tfgc's buckets.
    found = traced("none", "allreduce", 1)
    assert found and all(0 in layers for layers in found), found


# -- a real cluster ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return run_cluster(tmp_path_factory, "overlap", SCRIPT)


@pytest.mark.parametrize("k", range(len(worker.SPECS)),
                         ids=[f"{s}@{c}" for s, c in worker.SPECS])
def test_buckets_give_the_bits_of_one_bucket(cluster, k):
    runs = {(mode, r): np.load(cluster / f"{k}.{mode}.w{r}.npz")
            for mode in ("buckets", "one") for r in range(2)}
    reference = runs["one", 0]
    assert len(reference.files) > len(worker.SHAPES) * worker.STEPS  # outputs and state
    for key in reference.files:
        for (mode, r), run in runs.items():
            # Outputs are the same on every worker; each worker has its own state.
            expected = runs["one", r] if key.startswith("state") else reference
            np.testing.assert_array_equal(run[key], expected[key],
                                          err_msg=f"{key}, {mode}, worker {r}")
    # And the outputs are sums, not zeros.
    assert np.any(reference["out0_0"] != 0)


DETERMINISTIC_PIECES = [k for k, (s, _) in enumerate(worker.PIECE_SPECS)
                        if s in ("signsgd", "bf16")]
STOCHASTIC_PIECES = [k for k, (s, _) in enumerate(worker.PIECE_SPECS)
                     if s.startswith(("qsgd", "terngrad"))]


def _piece_runs(cluster, k):
    return {(mode, r): np.load(cluster / f"piece{k}.{mode}.w{r}.npz")
            for mode in ("pieces", "one") for r in range(2)}


@pytest.mark.parametrize("k", DETERMINISTIC_PIECES,
                         ids=[worker.PIECE_SPECS[k][0] for k in DETERMINISTIC_PIECES])
def test_pieces_give_the_bits_of_the_whole_gradient(cluster, k):
    # signSGD's and the casts' pieces are ranges of elements, each coded on its own
    # as in the whole chunk: both stages, the same bits.
    runs = _piece_runs(cluster, k)
    reference = runs["one", 0]
    assert any(key.startswith("state") for key in reference.files)
    for key in reference.files:
        for (mode, r), run in runs.items():
            own = key.startswith(("state", "slot_"))  # each worker's own state
            expected = runs["one", r] if own else reference
            np.testing.assert_array_equal(run[key], expected[key],
                                          err_msg=f"{key}, {mode}, worker {r}")
    assert np.any(reference["out0_0"] != 0)


@pytest.mark.parametrize("k", STOCHASTIC_PIECES,
                         ids=[worker.PIECE_SPECS[k][0] for k in STOCHASTIC_PIECES])
def test_pieces_of_a_stochastic_quantizer_err_as_the_whole_gradient_does(cluster, k):
    # Pieces draw other random numbers than the whole chunk, from the same
    # distribution: QSGD's pieces fall on whole buckets, TernGrad's share the
    # gradient's scaler. So the error against the exact sum is unbiased and as large.
    runs = _piece_runs(cluster, k)
    for step in range(worker.STEPS):
        key = f"out{step}_0"
        # The workers agree, in pieces as whole.
        for mode in ("pieces", "one"):
            np.testing.assert_array_equal(runs[mode, 1][key], runs[mode, 0][key])
        exact = sum(worker.gradients(r, step, worker.PIECE_SHAPES)[0] for r in range(2))
        pieces = runs["pieces", 0][key] - exact
        whole = runs["one", 0][key] - exact
        rms = np.sqrt(np.mean(pieces ** 2))
        # Over 393,216 elements the mean square's relative spread is well under 1 %.
        assert 0.9 < rms / np.sqrt(np.mean(whole ** 2)) < 1.1, (step, rms)
        assert abs(np.mean(pieces)) < 6 * rms / np.sqrt(pieces.size), step
        # Not a shifted copy: each element's error is its own draw's.
        assert not np.array_equal(pieces, whole)


def test_error_feedback_in_pieces_loses_nothing(cluster):
    # EF-signSGD in pieces (each with its own scale): what was applied plus both
    # workers' residuals (their own, and the second one of the chunk each owns) is
    # every gradient ever sent, as whole.
    k = [s for s, _ in worker.PIECE_SPECS].index("efsignsgd")
    n, shape = 2, worker.PIECE_SHAPES[0]
    recompression = tfgc.get_compressor("efsignsgd").chunk_recompression
    plan = collectives.chunk_plan(recompression.chunk_layout(tf.TensorShape(shape), n),
                                  tf.TensorShape(shape), n)
    for mode in ("pieces", "one"):
        runs = [np.load(cluster / f"piece{k}.{mode}.w{r}.npz") for r in range(n)]
        applied = sum(runs[0][f"out{s}_0"].astype(np.float64) for s in range(worker.STEPS))
        held = [run["slot_server_residual"] for run in runs]
        owners = plan.join([h[:int(c.num_elements())] for h, (_, _, c) in
                            zip(held, plan.chunks)], shape).numpy().astype(np.float64)
        left = owners + sum(run["slot_residual"].astype(np.float64) for run in runs)
        sent = sum(worker.gradients(r, s, worker.PIECE_SHAPES)[0].astype(np.float64)
                   for r in range(n) for s in range(worker.STEPS))
        np.testing.assert_allclose(applied + left, sent, rtol=1e-5, atol=1e-4, err_msg=mode)
        assert np.any(owners != 0) and np.any(applied != 0), mode
    # The pieces' scales are their own: other bits than whole.
    pieces = np.load(cluster / f"piece{k}.pieces.w0.npz")["out0_0"]
    assert not np.array_equal(pieces, np.load(cluster / f"piece{k}.one.w0.npz")["out0_0"])


def test_the_reduce_scatter_names_what_it_sends_as_it_is(cluster):
    # The single-element kernel has fewer elements than the 2 workers: sent as it is,
    # with the path's reason; the bias with the policy's.
    with open(cluster / "piece0.pieces.w0.json") as f:
        run = json.load(f)
    names = run["names"]
    listed = {e["variable"]: e for e in run["uncompressed"]}
    assert set(listed) == {names[1], names[3]}
    assert listed[names[3]]["reason"] == "fewer elements than workers (reduce-scatter)"
    assert listed[names[1]]["reason"] == "a vector (compress_vectors=False)"
    assert run["stats"]["uncompressed_tensors"] == 2
    assert run["stats"]["uncompressed_bytes"] == 4 * (512 + 1)


@pytest.mark.parametrize("k", range(len(worker.NONFINITE_SPECS)),
                         ids=[f"{s}@{c}" for s, c in worker.NONFINITE_SPECS])
def test_a_nan_in_one_bucket_skips_the_whole_step_on_every_worker(cluster, k):
    kernels = [j for j, s in enumerate(worker.SHAPES) if len(s) == 2]
    for r in range(2):
        run = np.load(cluster / f"nonfinite{k}.w{r}.npz")
        with open(cluster / f"nonfinite{k}.w{r}.json") as f:
            assert json.load(f)["skipped"] == 1
        # Every kernel's output is NaN, the first-reduced bucket's too, though its
        # gradients were finite everywhere; the dense biases are summed as ever.
        for j in kernels:
            assert np.all(np.isnan(run[f"bad_out{j}"])), (r, j)
        for j in set(range(len(worker.SHAPES))) - set(kernels):
            assert np.all(np.isfinite(run[f"bad_out{j}"])), (r, j)
        states = sorted(key[len("before"):] for key in run.files if key.startswith("before"))
        assert states
        for j in states:
            np.testing.assert_array_equal(run[f"after{j}"], run[f"before{j}"])
        # The next good step goes on: finite outputs, the state moves.
        for j in range(len(worker.SHAPES)):
            assert np.all(np.isfinite(run[f"next_out{j}"])), (r, j)
        assert any(not np.array_equal(run[f"next{j}"], run[f"before{j}"]) for j in states)


# -- the network benchmark's overlap figures ---------------------------------------

def test_network_report_sets_step_against_floor_and_wire():
    from cluster_scripts import benchmark_module
    report = benchmark_module("network_report")

    def run(config, rate, ms, tx):
        return {"kind": "main", "model": "m", "workers": 4, "config": config, "rate": rate,
                "status": "ok", "median_ms": ms, "veth_tx_per_step_max": tx}

    runs = [run("stock", "10gbit", 100.0, 4e6), run("stock", "100mbit", 400.0, 4e6),
            run("q", "10gbit", 100.0, 1e6), run("q", "100mbit", 150.0, 1e6)]
    report.add_speedups(runs)
    q = runs[3]
    assert q["wire_ms"] == pytest.approx(80.0)  # 1 MB at 100 Mbit/s
    assert q["floor_ms"] == 100.0
    assert q["vs_max"] == pytest.approx(1.5)
    assert q["vs_sum"] == pytest.approx(150.0 / 180.0)
    assert q["speedup"] == pytest.approx(400.0 / 150.0)
    assert "vs_max" not in runs[2]  # the floor itself


def test_network_configurations_take_bucket_and_overlap_options():
    from cluster_scripts import benchmark_module
    report = benchmark_module("network_report")
    assert report.split_options("reduce_scatter:bucket_mb=4,overlap_mb=0") == (
        "reduce_scatter", {"bucket_bytes": 4 << 20, "overlap_bytes": 0})
    assert report.split_options("auto:overlap_mb=16") == ("auto", {"overlap_bytes": 16 << 20})
    assert report.split_options("allgather") == ("allgather", {})
    for bad in ("auto:bucket_mb=0", "auto:overlap_mb=-1", "auto:overlap=1", "auto:overlap_mb"):
        with pytest.raises(ValueError, match="options"):
            report.split_options(bad)
