"""Keras 3 (``import keras``) trains multi-worker under tfgc's strategy.

The stock MultiWorkerMirroredStrategy cannot run Keras 3's ``model.fit``
(keras-team/keras#20585). One 2-worker cluster (tests/cluster/keras3_fit.py) trains
the MLP of the other distributed tests with Keras 3 three times; the tests read what
it left behind:

* the identity compressor, replayed here in one process from the batches each
  worker was fed: the cluster's weights must equal the replay's bit for bit;
* ef+topk and QSGD: identical weights on both workers, bytes equal to the wire
  formula of the tf-keras sweep, training that learns, the stats callback,
  ``model.evaluate``, a checkpoint round trip of the residuals, and XLA turned off;
* then, on a second strategy in the same processes, the models users bring of
  tests/test_user_models.py under a few compressors (one cluster for both).

The single-process tests check the strategy's ``reduce`` for what Keras 3 asks of it.
"""

import importlib.util
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from cluster_scripts import run_cluster
from test_distributed import DENSE_BYTES, REPO, expected_bytes
from test_user_models import AUTO_EVERY, KERAS3_MIXED_SPECS, KERAS3_SPECS, MODELS, check_run

keras = pytest.importorskip("keras")
if int(keras.__version__.split(".")[0]) < 3:  # pragma: no cover - tf-keras-only installs
    pytest.skip("Keras 3 is not installed", allow_module_level=True)

SCRIPT = os.path.join(REPO, "tests", "cluster", "keras3_fit.py")


def _script():
    spec = importlib.util.spec_from_file_location("keras3_fit", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def keras3_run(tmp_path_factory):
    return run_cluster(tmp_path_factory, "keras3", SCRIPT, timeout=1200, args=[
        "--user-models", "--specs", *KERAS3_SPECS, "--auto_every", AUTO_EVERY,
        "--precisions", "float32", "mixed_float16", "--mixed_specs", *KERAS3_MIXED_SPECS])


def _load(out, name, rank):
    with open(out / f"{name}.w{rank}.json") as f:
        results = json.load(f)
    with np.load(out / f"{name}.w{rank}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return results, arrays


def _weights(arrays, prefix="w"):
    keys = sorted((k for k in arrays if k.startswith(prefix) and k[len(prefix):].isdigit()),
                  key=lambda k: int(k[len(prefix):]))
    return [arrays[k] for k in keys]


def test_identity_equals_a_single_process_replay_bit_for_bit(keras3_run):
    """2 workers, compressor "none": each step sums the two workers' gradients of their
    own batches (the loss scaled by 1/2, as Keras 3 does under a strategy), then plain
    SGD. The replay runs the same model and optimizer in this process, without any
    strategy; with two workers the sum has one order, so equality is exact."""
    script = _script()
    results = [_load(keras3_run, "none", r) for r in range(2)]
    _, a0 = results[0]
    _, a1 = results[1]
    assert results[0][0]["num_workers"] == 2
    model = script.build(keras, seed=3)
    initial = _weights(a0, "init_w")
    # Both workers started from the same weights, those of the seeded build.
    for w, v, o in zip(initial, model.weights, _weights(a1, "init_w")):
        np.testing.assert_array_equal(w, v.numpy())
        np.testing.assert_array_equal(w, o)
    optimizer = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    @tf.function
    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) * 0.5
        return tape.gradient(loss, [v.value for v in variables])

    # Different per-worker batches: the workers really trained on their own shards.
    assert not np.array_equal(a0["x0"], a1["x0"])
    for step in range(script.STEPS_NONE):
        g0 = gradients(a0[f"x{step}"], a0[f"y{step}"])
        g1 = gradients(a1[f"x{step}"], a1[f"y{step}"])
        optimizer.apply([x + y for x, y in zip(g0, g1)], variables)
    final = _weights(a0)
    assert not all(np.array_equal(a, b) for a, b in zip(final, initial))
    for got, want in zip(final, model.weights):
        np.testing.assert_array_equal(got, want.numpy())
    for a, b in zip(final, _weights(a1)):
        np.testing.assert_array_equal(a, b)


def test_identity_reaches_the_strategy(keras3_run):
    results, _ = _load(keras3_run, "none", 0)
    # Every step's gradients went through tfgc's reduction, with state per kernel.
    assert results["stats"]["steps"] == _script().STEPS_NONE
    assert results["stats"]["sent_bytes"] == DENSE_BYTES  # 2 workers: the ring sends n
    assert results["state_slots"] == 3


@pytest.mark.parametrize("name,spec", [("eftopk", "ef+topk:ratio=0.01"), ("qsgd", "qsgd")])
def test_compressed_fit_matches_on_workers_and_formula(keras3_run, name, spec):
    (r0, a0), (r1, a1) = (_load(keras3_run, name, r) for r in range(2))
    for a, b in zip(_weights(a0), _weights(a1)):
        np.testing.assert_array_equal(a, b)
    payload, sent = expected_bytes(spec, 2)
    for r in (r0, r1):
        assert r["reductions"] > 0
        assert r["stats"]["payload_bytes"] == payload
        assert r["stats"]["sent_bytes"] == sent
        assert r["stats"]["dense_bytes"] == DENSE_BYTES
        # model.evaluate gives every worker the same figures, and training learned
        # (chance is 0.1; the dense MLP reaches about 0.87 in two epochs).
        assert r["evaluate"] == r0["evaluate"]
        assert r["evaluate"]["accuracy"] > 0.6


def test_stats_callback_jit_and_checkpoint(keras3_run):
    results, _ = _load(keras3_run, "eftopk", 0)
    history = results["history"]
    payload, sent = expected_bytes("ef+topk:ratio=0.01", 2)
    # CompressionStatsCallback's figures land in Keras 3's History.
    assert history["sent_MB"] == [pytest.approx(sent / 1e6)] * 2
    assert history["dense_sent_MB"] == [pytest.approx(DENSE_BYTES / 1e6)] * 2
    assert history["loss"][1] < history["loss"][0]
    # Loss and accuracy are the cluster's (averaged, not summed over workers).
    assert 0.0 < history["accuracy"][0] <= 1.0
    # jit_compile=True was asked for; the strategy turned XLA off.
    assert results["jit_compile"] is False
    # The residuals are saved with the Keras 3 optimizer and restored into the state.
    assert results["state_slots"] == 3
    assert len(results["norms"]) == 3 and all(v > 0 for v in results["norms"].values())
    assert all(v == 0 for v in results["zeroed"].values())
    assert results["restored"] == results["norms"]
    # The callback finds each Keras 3 kernel's residual (a Keras 3 variable wraps the
    # TensorFlow variable that the state is kept for), named by the layer's path.
    residuals = {tag: v for tag, v in results["scalars"].items()
                 if tag.startswith("residual_norm/")}
    assert len(residuals) == 3, residuals
    assert all(re.fullmatch(r"residual_norm/sequential(_\d+)?/dense(_\d+)?/kernel", tag)
               for tag in residuals), residuals
    assert sorted(residuals.values()) == pytest.approx(sorted(results["norms"].values()))


def test_the_auto_plan_callback_runs_under_keras3(keras3_run):
    # AutoPlanCallback is a tf-keras callback; Keras 3's fit calls it all the same, and
    # its changes of plan retrace Keras 3's train function.
    script = _script()
    runs = [_load(keras3_run, "auto", rank) for rank in range(2)]
    results = [r for r, _ in runs]
    assert results[0]["plans"] == results[1]["plans"]
    assert results[0]["intervals"] == results[1]["intervals"]
    for a, b in zip(_weights(runs[0][1]), _weights(runs[1][1])):
        np.testing.assert_array_equal(a, b)
    plans = results[0]["plans"]
    assert len(plans) == script.AUTO_STEPS
    # plans[k]: what step k + 2 takes. Measured once the first plan's steps are timed
    # (the first step traces, the second settles) or at the first interval's end,
    # while every gradient is critical: from then on the kernels go low-rank at rank 4
    # or more; before, none does.
    callback = tfgc.keras.AutoPlanCallback
    measured = min(callback.SETTLE_STEPS + callback.LOW_RANK_AFTER, script.AUTO_EVERY - 1)
    assert not any(label.startswith("psgd") for k in range(measured)
                   for _, label, _ in plans[k]), plans[:measured]
    assert all(critical for _, _, critical in plans[measured])
    ranks = [int(label[4:]) for _, label, _ in plans[measured] if label.startswith("psgd")]
    assert ranks and min(ranks) >= 4, plans[measured]
    assert [epoch for epoch, _, _ in results[0]["intervals"]] == \
        [0] * (script.AUTO_STEPS // script.AUTO_EVERY)
    assert results[0]["change_s"] > 0  # the step after the change retraced
    assert results[0]["loss"][0] == results[0]["loss"][0]  # finite


@pytest.mark.parametrize("loss_scaled", [False, True])
def test_the_auto_plan_callback_reads_a_keras3_optimizers_scheduled_rate(loss_scaled):
    # As tests/test_auto.py's tf-keras case: a step decay after step 10, intervals of 5
    # steps, the same rows every step; the interval after the decay makes every
    # planned gradient critical, through Keras 3's optimizer (and its loss scaling).
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    with strategy.scope():
        model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(64),
                                  keras.layers.Dense(4)])
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([10], [0.01, 0.001])
        optimizer = keras.optimizers.SGD(schedule)
        if loss_scaled:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss="mse")
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=5, link_margin=None)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(8, 40)).astype(np.float32),
              rng.normal(size=(8, 4)).astype(np.float32), batch_size=8, epochs=20,
              shuffle=False, verbose=0, callbacks=[callback])
    names = sorted(e.name for e in strategy.compression_plan().entries)
    assert names
    assert [critical for _, critical, _ in callback.history] == [names, [], names, []]


def test_mixed_precision_skips_a_step_that_overflows_on_one_worker_everywhere(keras3_run):
    # Keras 3's LossScaleOptimizer checks each worker's own gradients before the
    # all-reduce: without tfgc's agreement the worker that overflowed skipped the
    # all-reduce the other entered, and the cluster hung (this run never finished).
    script = _script()
    runs = [_load(keras3_run, "mixed", rank) for rank in range(2)]
    for r, _ in runs:
        assert r["policy"] == "mixed_float16" and r["optimizer"] == "LossScaleOptimizer"
        assert r["steps"] == script.MIXED_STEPS
        # The overflow on worker 1 skipped the step on both (any other overflow would
        # have hit both workers' gradients alike and is counted the same on both).
        assert r["nonfinite_steps"] >= 1
        assert (r["nonfinite_steps"], r["scale"]) == (runs[0][0]["nonfinite_steps"],
                                                      runs[0][0]["scale"])
    # Each skipped step halves the loss scale (Keras 3's initial scale: 2**15).
    assert runs[0][0]["scale"] == 2.0 ** 15 / 2 ** runs[0][0]["nonfinite_steps"]
    for a, b in zip(_weights(runs[0][1]), _weights(runs[1][1])):
        np.testing.assert_array_equal(a, b)
        assert np.all(np.isfinite(a))


def test_every_compressor_trains_under_keras3(keras3_run):
    script = _script()
    runs = [_load_json(keras3_run, "sweep", r) for r in range(2)]
    assert sorted(runs[0]) == sorted(script.SWEEP)
    for spec in script.SWEEP:
        mine, theirs = runs[0][spec], runs[1][spec]
        assert mine["reductions"] == script.SWEEP_STEPS, spec
        assert np.isfinite(mine["loss"]), spec
        if spec == "gradiveq":  # learns its basis from dense gradients in the first window
            assert mine["payload_bytes"] == DENSE_BYTES
        else:
            assert 0 < mine["payload_bytes"] < DENSE_BYTES, spec
        assert mine["checksum"] == theirs["checksum"], spec  # the same weights
        assert mine["loss"] == theirs["loss"], spec


def _load_json(out, name, rank):
    with open(out / f"{name}.w{rank}.json") as f:
        return json.load(f)


# ---------------------------------------------------------------------------
# Single process: the strategy's reduce for what Keras 3 asks


@pytest.fixture(scope="module")
def strategy():
    import tfgc

    return tfgc.CompressedMultiWorkerMirroredStrategy("none")


def test_reduce_takes_a_nest_and_scalar_axis(strategy):
    batch = (tf.constant([[1.0, 2.0], [3.0, 5.0]]), tf.constant([1, 2]))
    reduced = strategy.reduce("MEAN", batch, axis=None)
    assert isinstance(reduced, tuple) and len(reduced) == 2
    np.testing.assert_array_equal(reduced[0].numpy(), batch[0].numpy())
    # A rank-0 value has no axis 0: the reduction over replicas is all there is.
    assert float(strategy.reduce("MEAN", tf.constant(2.5), axis=0)) == 2.5
    # Reductions with an axis of a tensor of rank >= 1 keep their meaning.
    assert float(strategy.reduce("SUM", tf.constant([1.0, 2.0]), axis=0)) == 3.0
    assert float(strategy.reduce("MEAN", tf.constant([1.0, 2.0]), axis=0)) == 1.5
    out = strategy.reduce("SUM", {"a": tf.constant(1.0), "b": [tf.constant(2.0)]})
    assert float(out["a"]) == 1.0 and float(out["b"][0]) == 2.0


class OwnModel(keras.Model):
    """A user's subclass, defined outside the keras package."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("build", [
    lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
    OwnModel,
])
def test_variance_based_stops_a_keras3_model_before_training(strategy, build):
    strategy.compressor = "variance"
    try:
        with strategy.scope():
            model = build()
            model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(ValueError, match="tf-keras.*other compressor"):
            model.fit(np.zeros((8, 4), np.float32), np.zeros((8, 2), np.float32), verbose=0)
    finally:
        strategy.compressor = "none"


def test_several_steps_per_execution_stop_a_keras3_fit_before_training(strategy):
    # Keras 3 calls each step's tf.function inside a while loop, where TensorFlow's
    # collectives fail at the first step ("You must feed a value for placeholder");
    # the fit stops before it with what works instead, and the weights are untouched.
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    before = [w.numpy() for w in model.weights]
    with pytest.raises(ValueError, match="steps_per_execution=4.*steps_per_execution=1"):
        model.fit(np.ones((32, 4), np.float32), np.ones((32, 2), np.float32), batch_size=4,
                  verbose=0)
    for a, w in zip(before, model.weights):
        np.testing.assert_array_equal(a, w.numpy())


@pytest.mark.parametrize("loss_scaled", [False, True])
def test_gradient_accumulation_stops_a_keras3_fit_before_training(strategy, loss_scaled):
    # Keras 3 applies accumulated gradients inside a tf.cond, where no strategy can
    # all-reduce (the stock ones fail with a merge_call error naming tfgc's hook).
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        if loss_scaled:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        model.fit(np.ones((32, 4), np.float32), np.ones((32, 2), np.float32), batch_size=4,
                  verbose=0)


def test_several_steps_per_execution_train_a_tf_keras_model(strategy):
    # tf-keras runs the steps of an execution in one function: every step is reduced.
    import tf_keras

    stats = strategy.compression_stats()
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    history = model.fit(np.ones((40, 4), np.float32), np.ones((40, 2), np.float32),
                        batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert strategy.compression_stats()["steps"] - stats["steps"] == 10


def test_keras3_saves_say_once_that_they_leave_the_residuals_out(strategy, tmp_path,
                                                                 monkeypatch):
    from tfgc.distribute import keras_hooks

    warnings = []
    monkeypatch.setattr(keras_hooks, "_warned_keras3_save", False)
    monkeypatch.setattr(keras_hooks.logging, "warning",
                        lambda msg, *args: warnings.append(msg % args))

    def trained(spec):
        strategy.compressor = spec
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((16, 64), np.float32), np.ones((16, 32), np.float32), batch_size=8,
                  verbose=0)
        return model

    try:
        # QSGD keeps no residual: nothing is left out, nothing said.
        trained("qsgd").save_weights(str(tmp_path / "q.weights.h5"))
        assert warnings == []
        model = trained("ef+topk:ratio=0.1")
        model.save_weights(str(tmp_path / "e.weights.h5"))
        model.save(str(tmp_path / "e.keras"))
    finally:
        strategy.compressor = "none"
    assert len(warnings) == 1, warnings
    assert "save_weights" in warnings[0] and "tensors on this worker: 1" in warnings[0]
    assert "tf.train.Checkpoint" in warnings[0]


def test_tf_keras_models_are_not_taken_for_keras3():
    import tf_keras

    from tfgc.distribute.keras_hooks import _is_keras3

    assert not _is_keras3(tf_keras.Sequential())
    assert _is_keras3(keras.Sequential()) and _is_keras3(OwnModel())


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("i,spec", list(enumerate(KERAS3_SPECS)))
def test_user_models_under_keras3(keras3_run, model, i, spec):
    # Keras 3 keeps batch normalization's moving statistics per worker (they are not
    # gradients and tfgc does not reduce them; tf-keras all-reduces them itself), so
    # the trainable weights are compared.
    check_run(keras3_run / "user_models", model, "float32", i, spec, trainable_only=True)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("i,spec", list(enumerate(KERAS3_MIXED_SPECS)))
def test_user_models_under_keras3_mixed_float16(keras3_run, model, i, spec):
    # Keras 3's loss scale starts at 2**15 and halves at each step it skips: on the
    # Transformer its first steps overflow (2 of 24 measured), on every worker alike.
    check_run(keras3_run / "user_models", model, "mixed_float16", i, spec,
              trainable_only=True, skipped_steps=4)
