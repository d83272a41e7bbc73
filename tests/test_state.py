"""Compression state users can trust, on real 2-worker clusters (TF_CONFIG on localhost,
TensorFlow's collectives): only gradients are compressed, state is per variable and
per optimizer, checkpointed per worker, untouched by non-finite steps, and workers
that disagree stop with a message instead of training on misaligned payloads.

Fixtures start few clusters: ``checks`` runs every check of
``tests/cluster/state_checks.py`` in one launch; ``disagree_*`` and ``killed`` are
launches that fail, or restart, on purpose.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from cluster_scripts import cluster_script
from tfgc.apps.launch import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(REPO, "tests", "cluster")
ENV = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "TF_CPP_MIN_LOG_LEVEL": "2"}
NONFINITE_SPECS = ["ef+topk:ratio=0.01", "onebit", "efsignsgd", "randomk:ratio=0.05"]


def run(out, script, workers=2, args=(), restarts=0, timeout=600):
    return launch([sys.executable, os.path.join(CLUSTER, script), *map(str, args)], workers,
                  env=ENV, timeout=timeout, restarts=restarts, output=open(os.devnull, "w"))


def load(out, name, rank):
    with open(out / f"{name}.w{rank}.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("state_checks")
    result = run(out, "state_checks.py", args=[out, "--nonfinite-specs", *NONFINITE_SPECS])
    assert result.ok, result.message
    return out


def test_user_all_reduce_and_strategy_reduce_are_exact(checks):
    for rank in (0, 1):
        r = load(checks, "exact", rank)
        # A [64, 64] float all-reduce under top-k used to come back with 41
        # non-zeros and count as a training step.
        assert r["replica_sum_nonzeros"] == 64 * 64
        assert r["replica_sum_err"] < 1e-5 and r["reduce_err"] < 1e-5
        assert r["steps_counted"] == 0


@pytest.mark.parametrize("spec", NONFINITE_SPECS)
def test_nonfinite_step_leaves_state_untouched(checks, spec):
    for rank in (0, 1):
        r = load(checks, "nonfinite", rank)[spec]
        # Only the last worker saw the NaN, yet every worker skipped the step...
        assert r["skipped"] == 1
        assert r["weights_unchanged"]
        assert r["scale_after"] == r["scale_before"] / 2
        # ...and kept its state (residuals, step counter) bit for bit.
        assert r["state_fields"] >= 1 and r["state_unchanged"] and r["state_finite"]
        assert r["finite_after"] and r["state_finite_after"]
    with np.load(checks / "nonfinite.w0.npz") as a, np.load(checks / "nonfinite.w1.npz") as b:
        for key in a.files:
            if key.startswith(spec + "/"):
                np.testing.assert_array_equal(a[key], b[key])


def test_checkpoint_restores_each_workers_own_state(checks):
    norms = []
    for rank in (0, 1):
        r = load(checks, "checkpoint", rank)
        # Restored from worker 0's checkpoint into a fresh model and optimizer
        # before their first step (a deferred restoration)...
        assert r["deferred"]
        # ...one more step matches the uninterrupted run bit for bit, residuals
        # and step counter included.
        assert r["same_weights"] and r["same_state"]
        norms.append(r["norms_saved"])
    # The workers' residuals differ, so each got its own back, not worker 0's.
    assert norms[0] != norms[1]
    with np.load(checks / "checkpoint.w0.npz") as a, np.load(checks / "checkpoint.w1.npz") as b:
        assert any(not np.array_equal(a[k], b[k]) for k in a.files)


def test_checkpoint_of_two_workers_restores_on_one_keeping_the_residual_mass(checks, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(ENV)
    proc = subprocess.run(
        [sys.executable, os.path.join(CLUSTER, "state_checks.py"), str(tmp_path), "--checks",
         "restore_elsewhere", "--checkpoint", str(checks / "ckpt_w0" / "state")],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    restored = load(tmp_path, "restore_elsewhere", 0)
    with np.load(checks / "checkpoint_saved.w0.npz") as a, \
            np.load(checks / "checkpoint_saved.w1.npz") as b:
        # Variable 0 is the step counter; the others are the residuals, in order.
        totals = [np.linalg.norm((a[k].astype(np.float64) + b[k]).ravel())
                  for k in sorted(a.files, key=int)[1:]]
        step = int(a["0"])
    # One worker now holds the sum of both workers' residuals; the counter is kept.
    assert sorted(restored["restored_norms"].values()) == pytest.approx(sorted(totals), rel=1e-6)
    assert restored["step"] == step + 1


def test_two_models_do_not_share_state(checks):
    for rank in (0, 1):
        r = load(checks, "two_models", rank)
        assert r["identical_to_alone"] and r["changed"]
        assert r["distinct_states"] == 3
        live_before, live_after = r["live_states"]
        assert live_after == live_before - 1, "a dropped model's state stayed alive"


def test_switching_compressor_mid_fit_takes_effect_next_batch(checks):
    for rank in (0, 1):
        r = load(checks, "switch", rank)
        dense = r["dense"]
        # none for batches 0-3, then top-1% from batch 4 on, in the same fit().
        assert r["payloads"][:4] == [dense] * 4
        assert all(p < dense / 20 for p in r["payloads"][4:]) and len(r["payloads"]) == 8


def test_switching_between_stateful_compressors_mid_fit_keeps_residuals(checks):
    # none, then DGC at 1 % (a residual and a momentum per kernel; momentum on the
    # dense biases too), gradient dropping (a residual), QSGD (no state), each from the
    # batch after a callback switched to it, in one fit.
    worker = cluster_script("state_checks")[1]
    runs = [load(checks, "switch_state", rank) for rank in (0, 1)]
    with np.load(checks / "switch_state.w0.npz") as a, \
            np.load(checks / "switch_state.w1.npz") as b:
        for key in a.files:  # every worker ends with the same bits
            np.testing.assert_array_equal(a[key], b[key])
            assert np.all(np.isfinite(a[key]))
        kernels = [i for i, key in enumerate(sorted(a.files, key=int)) if a[key].ndim > 1]
    r = runs[0]
    dense, payloads = r["dense"], r["payloads"]
    assert r["steps"] == worker.SWITCH_STATE_STEPS == len(payloads)
    assert all(np.isfinite(r["loss"]))
    # Each compressor from the batch after its switch: its payload and its state.
    assert payloads[:3] == [dense] * 3
    assert all(p < dense / 20 for p in payloads[3:9]), payloads  # 1 % kept or sent
    assert all(dense / 20 < p < dense / 2 for p in payloads[9:]), payloads
    assert r["fields"][:3] == [[]] * 3
    assert r["fields"][3:6] == [["momentum", "residual"]] * 3
    assert r["fields"][6:9] == [["residual"]] * 3
    assert r["fields"][9:] == [[]] * 3
    for batch, held in enumerate(r["carried"]):
        if batch < 9:
            # DGC's residual joined gradient dropping's residual field: nothing kept apart.
            assert held == [None] * len(held), (batch, held)
        else:
            # Gradient dropping's residuals, kept apart for QSGD's first step, which sent
            # and zeroed them; the biases had none (sent dense).
            assert [i for i, h in enumerate(held) if h is not None] == kernels
            assert all(held[i] == 0.0 for i in kernels), held
    # Only DGC's momentum is dropped (gradient dropping keeps no such field), with a
    # warning at the switch that names it; no residual is dropped.
    dropped = [(batch, text) for batch, text in r["warnings"] if "dropped" in text]
    assert len(dropped) == 1 and dropped[0][0] == 6, r["warnings"]
    assert "keeps no state field momentum;" in dropped[0][1], dropped


def test_stale_tf_function_fails_with_a_clear_message(checks):
    for rank in (0, 1):
        assert "compressor was switched after this tf.function was traced" in \
            load(checks, "stale", rank)["message"]


def test_float64_goes_dense_and_embeddings_are_counted(checks):
    r0, r1 = load(checks, "dtypes", 0), load(checks, "dtypes", 1)
    assert r0["float64_steps"] == 2
    assert r0["float64_payload"] == r0["float64_dense"] == 8 * (100 * 64 + 64 + 64 * 10 + 10)
    assert r0["float64_weights"] == r1["float64_weights"]
    emb = r0["embedding"]
    # Top-k takes the embedding's gradient as a dense [1000, 16] table (its rows summed):
    # 1 % of it is 160 entries of 8 bytes. The 128 x 10 kernel goes top-1% (13 entries),
    # its bias dense, plus the guard's 9 control words.
    table = 8 * math.ceil(0.01 * 1000 * 16)
    assert emb["payload_bytes"] == table + 8 * math.ceil(0.01 * 1280) + 40 + 36
    assert emb["dense_bytes"] == 4 * (1000 * 16 + 1280 + 10)
    assert emb["sent_bytes"] == emb["payload_bytes"]  # (N-1) = 1 for gathers, 2(N-1)/N = 1


def test_workers_with_different_compressors_stop_naming_both(tmp_path):
    result = run(tmp_path, "disagree.py", args=["settings", "topk:ratio=0.01", "qsgd"],
                 timeout=300)
    assert not result.ok
    assert "compression settings differ" in result.message
    assert "'name': 'topk'" in result.message and "'name': 'qsgd'" in result.message
    assert "NOT STOPPED" not in "".join(result.outputs)


def test_partial_reset_of_step_counters_is_caught(tmp_path):
    result = run(tmp_path, "disagree.py", args=["steps"], timeout=300)
    assert not result.ok
    assert "step counters differ" in result.message
    assert "NOT STOPPED" not in "".join(result.outputs)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    out = tmp_path_factory.mktemp("killed")
    result = run(out, "kill_restart.py", args=[out], restarts=1, timeout=600)
    assert result.ok, result.message
    return out, result


def test_killed_worker_resumes_with_its_own_residuals(killed):
    out, result = killed
    assert result.restarts == 1
    restored, backed_up = [], []
    for rank in (0, 1):
        r = load(out, "restored", rank)
        backups = json.load(open(out / f"backups.w{rank}.a0.json"))
        # The last backup before the kill (batch 9 of epoch 0; worker 1 died at 12).
        last = backups["0/9"]
        assert (r["epoch"], r["batch"]) == (0, 10)
        assert set(r["norms"]) == set(last)
        for key, norm in last.items():
            assert norm > 0
            assert r["norms"][key] == pytest.approx(norm, rel=1e-9)
        restored.append(r["norms"])
        backed_up.append(last)
    assert backed_up[0] != backed_up[1], "workers' residuals should differ"
    finals = [load(out, "final", rank) for rank in (0, 1)]
    assert all(f["attempt"] == 1 and f["optimizer_iterations"] == 40 for f in finals)
    with np.load(out / "final.w0.npz") as a, np.load(out / "final.w1.npz") as b:
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key])


def test_a_long_compressor_key_is_cut_in_the_log_with_its_length():
    # auto's keys name every gradient: thousands of characters in one log line.
    from tfgc.distribute.state import _short_key
    assert _short_key("qsgd:levels=7") == "qsgd:levels=7"
    key = "auto:" + ";".join(f"block_{i}/kernel:0=rqsgd4@allgather" for i in range(50))
    short = _short_key(key)
    assert short.startswith(key[:160]) and short.endswith(f"... ({len(key)} characters)")
    assert len(short) < 200 < len(key)


def test_checkpoints_after_a_restore_before_the_first_step_keep_the_state(tmp_path):
    # BackupAndRestore's resume restores before the first step, before the state
    # exists; tf-keras's optimizer lists its children then and keeps that list. The
    # state joins it when it is made: later checkpoints hold it, and a later restore
    # restores into it (one process, one worker: the compressor still keeps its
    # residuals).
    import tensorflow as tf
    import tf_keras as keras

    import tfgc
    from tfgc.distribute.state import get_state

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 40)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32)

    def model():
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="ef+topk:ratio=0.05")
        with strategy.scope():
            m = keras.Sequential([keras.layers.Dense(64, input_shape=(40,)),
                                  keras.layers.Dense(4)])
            m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return m

    def residual(m):
        state = get_state(m.optimizer)
        return state.slot(m.layers[0].kernel, 0)["residual"].numpy()

    first = model()
    first.fit(x, y, batch_size=16, verbose=0)
    saved = tf.train.Checkpoint(optimizer=first.optimizer).save(str(tmp_path / "a"))
    resumed = model()
    tf.train.Checkpoint(optimizer=resumed.optimizer).restore(saved)  # before the state
    resumed.fit(x, y, batch_size=16, verbose=0)
    kept = residual(resumed)
    assert np.abs(kept).max() > 0
    again = tf.train.Checkpoint(optimizer=resumed.optimizer).save(str(tmp_path / "b"))
    assert any("tfgc_compression_state" in name for name, _ in tf.train.list_variables(again))
    resumed.fit(x, y, batch_size=16, verbose=0)
    assert not np.array_equal(residual(resumed), kept)
    tf.train.Checkpoint(optimizer=resumed.optimizer).restore(again)
    np.testing.assert_array_equal(residual(resumed), kept)


def test_a_child_tracked_late_joins_a_loss_scale_optimizers_listed_children():
    # The wrapper lists and tracks its children through the optimizer it wraps (a
    # custom loop may name the wrapper as the state's owner): the cached list there
    # takes the child too.
    import tensorflow as tf
    import tf_keras as keras

    from tfgc.distribute.state import track

    wrapper = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    plain = keras.optimizers.SGD(0.1)
    for owner in (wrapper, plain):
        assert "late" not in owner._trackable_children()  # the list is cached now
        child = tf.Module()
        track(owner, "late", child)
        assert owner._trackable_children()["late"] is child


def test_a_restore_on_another_cluster_size_keeps_residual_mass_and_shared_state():
    from tfgc.distribute.state import restored_values

    a, b = np.array([1.0, -2.0], np.float32), np.array([3.0, 0.5], np.float32)
    # The same size: each replica its own row.
    assert [v.tolist() for v in restored_values([a, b], [1], True, True, 2)] == [b.tolist()]
    # Two workers' residuals on one: their sum (held-back mass kept), float32 again.
    (one,) = restored_values([a, b], [0], False, True, 1)
    assert one.tolist() == [4.0, -1.5] and one.dtype == np.float32
    # ... on four (one worker with two replicas here): a quarter of it each; a single
    # worker's on two: half each.
    assert [v.tolist() for v in restored_values([a, b], [2, 3], False, True, 4)] == \
        [[1.0, -0.375]] * 2
    assert restored_values([a], [0, 1], False, True, 2)[1].tolist() == [0.5, -1.0]
    # Shared state (PowerSGD's query) is the first row, from one worker or several, on
    # any number: not doubled on one worker nor halved on two.
    for rows, n in (([a, a.copy()], 1), ([a], 2), ([a, a.copy()], 4)):
        assert [v.tolist() for v in restored_values(rows, [0], False, True, n, shared=True)] \
            == [a.tolist()]
    # Counters are copied.
    steps = [np.array(7, np.int64), np.array(9, np.int64)]
    assert restored_values(steps, [0], False, False, 3)[0] == 7


def test_the_shared_state_fields_are_the_compressors_own_and_no_others():
    import tensorflow as tf

    from tfgc.compressors import get, names, registry

    shared = registry.shared_state_fields()
    assert {"query", "basis", "mean", "samples", "count"} <= shared
    for name in names():
        compressor = get(name)
        inner = getattr(compressor, "inner", compressor)
        own = set(type(inner).shared_state)
        fields = set(compressor.init_state(tf.TensorShape([64, 48]), tf.float32))
        fields |= set(compressor.init_state(tf.TensorShape([64, 48]), tf.float32).get("inner", {}))
        # Each compressor's shared fields exist; none of its own fields (a residual, a
        # momentum) is taken for another compressor's shared one.
        assert own <= fields, name
        assert not (fields - own - {"inner"}) & shared, name
