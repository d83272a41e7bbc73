"""Buckets: a step's gradients reduced last layers first, as back-propagation makes them.

* ``plan``: the buckets' order and sizes;
* the traced graph: with buckets, the first collective of every path waits for none
  of the first layer's back-propagation (so it runs while that still computes); in
  one bucket, every collective waits for all of it;
* a real 2-worker cluster (``tests/cluster/overlap.py``, one launch): every path gives
  bit for bit the same outputs and state in one bucket per kernel as in one bucket for
  the whole step, workers agree, and a NaN in one worker's last bucket skips the whole
  step: every bucket's outputs NaN, no state written on any worker, training goes on.
"""

import json
import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc.apps.launch import launch
from tfgc.distribute import buckets

from cluster_scripts import ENV, cluster_script

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


# -- the traced graph --------------------------------------------------------------

LAYERS = 5
TRACED = [("ef+topk:ratio=0.1", "allgather"), ("fp16", "allreduce"),
          ("onebit", "reduce_scatter"), ("ef+topk:ratio=0.1", "shared_index"),
          ("ef+topk:ratio=0.1", "sparse_allreduce"), ("powersgd:rank=2", "low_rank")]


@pytest.fixture(scope="module")
def traced():
    """``trace(spec, communication, overlap_bytes)`` -> for each collective of one
    training step, in program order, the layers whose gradients it waits for."""
    import tf_keras as keras
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        policy=tfgc.CompressionPolicy(min_elements=1024))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x = tf.constant(np.random.RandomState(0).rand(16, 32).astype(np.float32))
    y = tf.constant(np.arange(16) % 10)

    def trace(spec, communication, overlap_bytes):
        fixed_reduce.use(strategy, spec, communication, overlap_bytes)
        with strategy.scope():
            net = keras.Sequential(
                [keras.layers.Dense(64, activation="relu", name=f"d{i}")
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


def test_identity_stays_one_bucket_as_the_stock_strategy_packs(traced):
    # "none" is the stock strategy's reduction bit for bit, at any cluster size: its
    # packs follow bytes_per_pack, never tfgc's buckets.
    found = traced("none", "allreduce", 1)
    assert found and all(0 in layers for layers in found), found


# -- a real cluster ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap")
    result = launch([sys.executable, SCRIPT, str(out)], 2, env=ENV, timeout=900,
                    output=open(os.devnull, "w"))
    assert result.ok, result.message
    return out


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
