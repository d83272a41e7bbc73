"""TensorBoard summaries of ``CompressionStatsCallback``, single process.

Without TF_CONFIG the strategy runs as one worker and still compresses, so a tiny
``model.fit`` exercises the whole path: the scalars read back from the event files
must equal ``strategy.compression_stats()`` as it stood at each write, and the
residual norms the norms of the optimizer's state computed here with NumPy. The
compressors' ``diagnostics`` are also checked on their own against hand-built state.
"""

import glob
import os
import pathlib

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfgc
from tfgc.compressors import DGC, ErrorFeedback, GradiVeQ, TopK, Variance, get as get_compressor
from tfgc.keras import CompressionStatsCallback

@pytest.fixture
def make_strategy():
    # Several strategies in one process: each gets collective keys of its own.
    def make(compressor, **kwargs):
        return tfgc.CompressedMultiWorkerMirroredStrategy(
            compressor=compressor, policy=tfgc.CompressionPolicy(min_elements=0), **kwargs)
    return make


def dense_model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(32, activation="relu", input_shape=(16,)),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def data(n=64, features=16, outputs=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = rng.normal(size=(n, outputs)).astype(np.float32)
    return x, y


class RecordStats(keras.callbacks.Callback):
    """Keeps ``compression_stats()`` after every batch and epoch, to compare with the events."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self.batches, self.epochs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(self.strategy.compression_stats())

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(self.strategy.compression_stats())


def read_events(run_dir):
    """{tag: {step: value}} from every event file in ``run_dir``."""
    files = sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    assert files, f"no event file in {run_dir}"
    out = {}
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                scalar = tf.make_ndarray(value.tensor)
                assert scalar.shape == () and scalar.dtype == np.float32
                out.setdefault(value.tag, {})[event.step] = float(scalar)
    return out


def assert_stats_written(events, stats, step, prefix=""):
    assert stats["steps"] > 0 and stats["payload_bytes"] > 0
    for field, value in stats.items():
        tag = f"{prefix}compression/{field}"
        assert tag in events, f"{tag} missing; written: {sorted(events)}"
        assert events[tag][step] == pytest.approx(float(np.float32(value)), rel=1e-6), tag


def residual(state, var, field="residual"):
    return np.asarray(state.slot(var, 0)[field].numpy(), np.float64)


def test_ef_topk_epoch_summaries(make_strategy, tmp_path):
    strategy = make_strategy("ef+topk:ratio=0.01")
    model = dense_model(strategy)
    record = RecordStats(strategy)
    cb = CompressionStatsCallback(strategy, log_dir=str(tmp_path))
    assert cb.log_dir == os.path.join(str(tmp_path), "worker0")
    x, y = data()
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb, record])
    # The Keras logs are as before.
    assert history.history["ratio"][-1] == pytest.approx(record.epochs[-1]["ratio"])
    assert os.listdir(tmp_path) == ["worker0"]
    events = read_events(os.path.join(tmp_path, "worker0"))
    for epoch, stats in enumerate(record.epochs):
        assert_stats_written(events, stats, epoch)
    assert set(events["compression/steps"]) == {0, 1}
    assert events["compression/steps"][1] == 8
    # Both kernels are compressed (min_elements=0 also lets the biases through the
    # policy, but vectors stay dense): one residual norm each, by variable name.
    state = strategy.compression_state(model.optimizer)
    kernels = [v for v in model.trainable_variables if len(v.shape) == 2]
    norms = sorted(t for t in events if t.startswith("residual_norm/"))
    assert norms == sorted(f"residual_norm/{v.name[:-2]}" for v in kernels)
    for var in kernels:
        expected = np.linalg.norm(residual(state, var).ravel())
        assert expected > 0
        written = events[f"residual_norm/{var.name[:-2]}"][1]
        assert written == pytest.approx(expected, rel=1e-6)
    # Top-k with error feedback has no diagnostics of its own.
    assert not [t for t in events if t.startswith("compressor/")]


def test_dgc_per_batch_summaries_follow_the_warmup(make_strategy, tmp_path):
    strategy = make_strategy("dgc:ratio=0.01,warmup_steps=2")
    model = dense_model(strategy)
    record = RecordStats(strategy)
    cb = CompressionStatsCallback(strategy, log_dir=tmp_path, update_freq=1, prefix="tfgc_")
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb, record])
    events = read_events(tmp_path / "worker0")
    assert len(record.batches) == 8
    for step, stats in enumerate(record.batches, start=1):
        assert_stats_written(events, stats, step, prefix="tfgc_")
    # Stage densities 1/4, 1/16, 1/64, then the ratio, two steps each; the payload
    # shrinks with them.
    density = events["tfgc_compressor/density"]
    assert [density[s] for s in range(1, 9)] == pytest.approx(
        [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01])
    payload = events["tfgc_compression/payload_bytes"]
    assert payload[1] > payload[3] > payload[5] > payload[7]
    # v (the residual) and u (the velocity) of each kernel, from the state itself.
    state = strategy.compression_state(model.optimizer)
    for var in (v for v in model.trainable_variables if len(v.shape) == 2):
        name = var.name[:-2]
        v_norm = np.linalg.norm(residual(state, var).ravel())
        u_norm = np.linalg.norm(residual(state, var, "momentum").ravel())
        assert v_norm > 0 and u_norm > 0 and abs(v_norm - u_norm) > 1e-3 * v_norm
        assert events[f"tfgc_residual_norm/{name}"][8] == pytest.approx(v_norm, rel=1e-6)
        assert events[f"tfgc_compressor/momentum_norm/{name}"][8] == pytest.approx(
            u_norm, rel=1e-5)
    # The biases are sent dense with a momentum buffer only: no residual, no diagnostics.
    assert not [t for t in events if "bias" in t]


def test_update_freq_writes_every_n_batches_across_epochs(make_strategy, tmp_path):
    strategy = make_strategy("ef+topk:ratio=0.01")
    model = dense_model(strategy)
    cb = CompressionStatsCallback(strategy, log_dir=str(tmp_path), update_freq=3)
    x, y = data(n=80)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])  # 10 batches
    events = read_events(os.path.join(tmp_path, "worker0"))
    assert sorted(events["compression/steps"]) == [3, 6, 9]
    assert [events["compression/steps"][s] for s in (3, 6, 9)] == [3, 6, 9]
    # A second fit counts on from the optimizer's iterations.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])  # 5 more
    events = read_events(os.path.join(tmp_path, "worker0"))
    assert sorted(events["compression/steps"]) == [3, 6, 9, 12, 15]


def test_gradiveq_reports_its_dimension(make_strategy, tmp_path):
    strategy = make_strategy("gradiveq:slice_size=8,max_dim=4,learn_steps=2,compress_steps=2")
    with strategy.scope():
        model = keras.Sequential([keras.layers.Conv2D(4, 3, input_shape=(6, 6, 2)),
                                  keras.layers.Flatten(), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, 6, 6, 2)).astype(np.float32)
    y = rng.normal(size=(48, 2)).astype(np.float32)
    cb = CompressionStatsCallback(strategy, log_dir=str(tmp_path), update_freq=1)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    events = read_events(os.path.join(tmp_path, "worker0"))
    kernel = model.layers[0].kernel
    name = kernel.name[:-2]
    dim, samples = events[f"compressor/dim/{name}"], events[f"compressor/samples/{name}"]
    # No basis after the first learning step; learned at the second.
    assert dim[1] == 0 and samples[1] == 1
    basis = strategy.compression_state(model.optimizer).slot(kernel, 0)["basis"].numpy()
    expected = int(np.sum(np.any(basis != 0, axis=0)))
    assert 1 <= expected <= 4 and dim[2] == dim[3] == expected and samples[3] == 2
    # GradiVeQ keeps no residual.
    assert not [t for t in events if t.startswith("residual_norm/")]


def test_without_log_dir_nothing_is_written(make_strategy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    strategy = make_strategy("ef+topk:ratio=0.01")
    model = dense_model(strategy)
    cb = CompressionStatsCallback(strategy)
    assert cb.log_dir is None
    x, y = data(n=32)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cb])
    assert {"sent_MB", "dense_sent_MB", "ratio", "wire_ratio"} <= set(history.history)
    assert os.listdir(tmp_path) == []


class StandIn:
    """Enough of a strategy for the constructor's checks."""

    worker_index = 0

    def compression_stats(self):
        return {}


@pytest.mark.parametrize("update_freq", [0, -2, 1.5, True, "steps", None, "Epoch"])
def test_bad_update_freq_names_the_argument(update_freq):
    with pytest.raises(ValueError, match="`update_freq`"):
        CompressionStatsCallback(StandIn(), log_dir="/tmp/unused", update_freq=update_freq)


@pytest.mark.parametrize("log_dir", [123, b"/tmp/logs", "", ["logs"], 1.5])
def test_bad_log_dir_names_the_argument(log_dir):
    with pytest.raises(ValueError, match="`log_dir`"):
        CompressionStatsCallback(StandIn(), log_dir=log_dir)


def test_good_arguments():
    cb = CompressionStatsCallback(StandIn(), log_dir=pathlib.Path("runs"), update_freq="batch")
    assert cb.log_dir == os.path.join("runs", "worker0") and cb._update_freq == 1
    assert CompressionStatsCallback(StandIn(), update_freq=5).log_dir is None


# -- the compressors' diagnostics, on their own -------------------------------------------


def test_base_diagnostics_are_empty():
    topk = get_compressor("topk:ratio=0.1")
    state = topk.init_state(tf.TensorShape([4, 4]), tf.float32)
    assert topk.diagnostics(state) == {} and topk.diagnostics(None, step=3) == {}
    ef = get_compressor("ef+topk:ratio=0.1")
    assert ef.diagnostics(ef.init_state(tf.TensorShape([4, 4]), tf.float32)) == {}


def test_error_feedback_reports_its_momentum_and_the_inner_figures():
    u = np.arange(6, dtype=np.float32).reshape(2, 3)
    for spec in ("onebit:momentum=0.9", "ef+topk:ratio=0.1,momentum=0.9"):
        ef = get_compressor(spec)
        state = dict(ef.init_state(tf.TensorShape([2, 3]), tf.float32), momentum=tf.constant(u))
        assert set(ef.diagnostics(state)) == {"momentum_norm"}, spec
        assert float(ef.diagnostics(state)["momentum_norm"]) == pytest.approx(
            np.linalg.norm(u)), spec
        assert ef.diagnostics(None, step=2) == {}, spec

    # What the inner compressor reports comes through, read from the inner state.
    class Counting(TopK):
        def diagnostics(self, state, step=None):
            if state is None:
                return {"step": tf.constant(float(step))}
            return {"size": tf.cast(tf.size(state["seen"]), tf.float32)}

        def init_state(self, shape, dtype):
            return {"seen": tf.zeros(shape, dtype)}

    ef = ErrorFeedback(Counting(ratio=0.5))
    state = ef.init_state(tf.TensorShape([2, 3]), tf.float32)
    assert float(ef.diagnostics(state)["size"]) == 6.0
    assert float(ef.diagnostics(None, step=4)["step"]) == 4.0


def test_dgc_density_matches_the_schedule():
    dgc = DGC(ratio=0.001, warmup_steps=3)
    for step in range(0, 25):
        expected = dgc.density_at(max(step - 1, 0))
        got = float(dgc.diagnostics(None, step=tf.constant(step, tf.int64))["density"])
        assert got == pytest.approx(expected), step
    assert dgc.diagnostics(None) == {}
    assert float(DGC(ratio=0.05).diagnostics(None)["density"]) == pytest.approx(0.05)
    u = np.arange(6, dtype=np.float32).reshape(2, 3)
    state = {"momentum": tf.constant(u), "residual": tf.zeros([2, 3])}
    assert float(dgc.diagnostics(state)["momentum_norm"]) == pytest.approx(np.linalg.norm(u))
    assert DGC(ratio=0.05, momentum=0.0).diagnostics(state) == {}


def test_gradiveq_dim_counts_the_kept_directions():
    gq = GradiVeQ(slice_size=8, max_dim=4, learn_steps=2, compress_steps=2)
    state = gq.init_state(tf.TensorShape([3, 3, 2, 4]), tf.float32)
    out = gq.diagnostics(state)
    assert int(out["dim"]) == 0 and float(out["samples"]) == 0
    rng = np.random.default_rng(2)
    samples = rng.normal(size=(6, 8)).astype(np.float32)
    cov = samples.T @ samples
    basis, _, d = gq.learn(tf.constant(cov), tf.constant(samples.sum(0)), tf.constant(6.0))
    state = dict(state, basis=basis, count=tf.constant(6.0))
    out = gq.diagnostics(state)
    assert int(out["dim"]) == int(d) and float(out["samples"]) == 6.0
    assert gq.diagnostics(None, step=5) == {}


def test_variance_reports_what_waits():
    var = Variance()
    r = np.array([[3.0, -4.0], [0.0, 0.0]], np.float32)
    out = var.diagnostics({"r": tf.constant(r), "v": tf.ones([2, 2]), "sent": tf.constant(1.0)})
    assert set(out) == {"held_norm", "send_rate"}
    assert float(out["held_norm"]) == pytest.approx(5.0)
    assert float(out["send_rate"]) == pytest.approx(0.25)
    assert var.diagnostics(None, step=1) == {}


def test_auto_writes_its_plan_as_text_once_per_plan(make_strategy, tmp_path):
    strategy = make_strategy("auto")
    model = dense_model(strategy)
    cb = CompressionStatsCallback(strategy, log_dir=str(tmp_path))
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    # One plan for both epochs: written once, at the first write, as plan.table() says.
    assert _texts(tmp_path) == [("compression/plan", 0, strategy.compression_plan().table())]


def test_auto_writes_every_plan_of_a_gan_as_text(make_strategy, tmp_path):
    # benchmarks/models.py's GAN (network.py runs it) reduces the discriminator's
    # gradients, then the generator's: a plan each, in that order, and both tables
    # written.
    from cluster_scripts import benchmark_module

    models = benchmark_module("models")
    strategy = make_strategy("auto")
    x, y = models.synthetic_data("gan", 0, 8)
    with strategy.scope():
        net, loss = models.build_model(keras, "gan")
        net.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    cb = CompressionStatsCallback(strategy, log_dir=str(tmp_path))
    net.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[cb])
    assert all(np.isfinite(v) for v in net.history.history["loss"])
    plans = strategy.compression_plans()
    assert len(plans) == 2
    for plan, part in zip(plans, (net.discriminator, net.generator)):
        names = {v.name for v in part.trainable_variables}
        assert plan.entries and {e.name for e in plan.entries} <= names, plan.table()
    assert strategy.compression_plan() is plans[1]  # the generator's, reduced last
    assert _texts(tmp_path) == [("compression/plan", 0,
                                 plans[0].table() + "\n\n" + plans[1].table())]


def _texts(log_dir):
    """Worker 0's text summaries: (tag, step, text)."""
    texts = []
    for path in glob.glob(os.path.join(log_dir, "worker0", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "text":
                    texts.append((value.tag, event.step,
                                  tf.make_ndarray(value.tensor).item().decode()))
    return texts
