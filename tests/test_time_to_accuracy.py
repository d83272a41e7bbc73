"""benchmarks/time_to_accuracy.py's driver: its plan, its target, its projections and
report (the runs themselves need root and a shaped cluster: the benchmark, not the
suite); and the MobileNetV2 it trains, as it builds it."""

import pytest

from cluster_scripts import benchmark_module

tta = benchmark_module("time_to_accuracy")


def _args(*argv):
    return tta.parse_args(["--models", "mlp", "--rates", "100mbit", "1gbit",
                           "--settings", "stock", "bf16", "ef", *argv])


def test_plan_floor_runs_first_then_rates_fastest_first():
    args = _args("--epochs", "2", "--floor", "stock", "ef")
    runs = tta.plan(args, {})
    assert [(r["rate"], r["setting"], r["role"]) for r in runs[:2]] == [
        ("10gbit", "stock", "floor"), ("10gbit", "ef", "floor_run")]
    assert [r["rate"] for r in runs[2:]] == ["1gbit"] * 3 + ["100mbit"] * 3
    # Compressed settings get twice the epochs; stock and bf16 the given ones.
    assert {r["setting"]: r["epochs"] for r in runs} == {"stock": 2, "bf16": 2, "ef": 4}
    # --compressed_epochs moves only the settings whose recommendation trains longer:
    # auto and 8-bit QSGD keep the dense schedule.
    args = tta.parse_args(["--models", "mlp", "--settings", "stock", "bf16", "qsgd", "auto",
                           "powersgd", "--epochs", "2", "--compressed_epochs", "5"])
    assert {r["setting"]: r["epochs"] for r in tta.plan(args, {})} == {
        "stock": 2, "bf16": 2, "qsgd": 2, "auto": 2, "powersgd": 5}
    assert all(r["budget"] == args.budget for r in runs if r["role"] == "run")


def test_no_rates_plans_the_floor_runs_alone():
    # Each setting's steps to the target on the floor link, nothing budgeted.
    args = tta.parse_args(["--models", "mobilenetv2", "--rates", "--settings", "stock", "auto",
                           "ef"])
    runs = tta.plan(args, {})
    assert [(r["rate"], r["setting"], r["role"]) for r in runs] == [
        ("10gbit", "stock", "floor"), ("10gbit", "auto", "floor_run"),
        ("10gbit", "ef", "floor_run")]
    assert all(r["budget"] > 1e8 for r in runs)


@pytest.mark.parametrize("argv, words", [
    (["--floor", "dgc"], "--floor names settings not in --settings"),
    (["--budget", "0"], "--budget must be > 0"),
    (["--target", "1.5"], "--target is an accuracy"),
    (["--rates", "fast"], "fast"),
])
def test_bad_arguments_stop_with_a_message(argv, words, capsys):
    with pytest.raises(SystemExit):
        _args(*argv)
    assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tta.parse_args(["--settings", "stock", "dgcc"])


def test_an_auto_setting_may_carry_the_plan_callbacks_options(capsys):
    assert tta.split_setting("auto~noise=0") == ("auto", {"noise": 0.0})
    assert tta.split_setting("auto:link_gbps=0.1") == ("auto:link_gbps=0.1", {})
    args = tta.parse_args(["--models", "cnn", "--settings", "auto", "auto~noise=0",
                           "--epochs", "2", "--compressed_epochs", "5"])
    # Both keep auto's schedule: the options are the callback's, not the compressor's.
    assert {r["setting"]: r["epochs"] for r in tta.plan(args, {})} == {
        "stock": 2, "auto": 2, "auto~noise=0": 2}
    for bad, words in [("auto~speed=1", "unknown callback option 'speed'"),
                       ("qsgd~noise=0", "for auto only")]:
        with pytest.raises(SystemExit):
            tta.parse_args(["--settings", "stock", bad])
        assert words in capsys.readouterr().err


def _run(setting, rate, role="run", reached_at=None, step_ms=100.0, steps=500, acc=0.8):
    run = {"model": "mlp", "rate": rate, "setting": setting, "role": role, "status": "ok",
           "epochs": 2, "reached": reached_at is not None, "median_step_ms": step_ms,
           "first_step_s": 2.0,
           "steps": steps, "train_s": steps * step_ms / 1e3, "best_accuracy": acc,
           "final_accuracy": acc, "sent_bytes_per_step": 1000, "spec": setting,
           "recommended": f"{'none' if setting == 'stock' else setting}, momentum SGD (0.9)",
           "curve": []}
    if reached_at is not None:
        run.update(steps_to_target=reached_at, time_to_target_s=reached_at * step_ms / 1e3)
    return run


def test_projections_and_speedups():
    runs = [_run("stock", "10gbit", role="floor", reached_at=300, step_ms=50),
            _run("ef", "10gbit", role="floor_run", reached_at=600, step_ms=20),
            # On the slow link stock spends its budget; ef reaches the target.
            _run("stock", "100mbit", step_ms=1000, steps=100),
            _run("ef", "100mbit", reached_at=600, step_ms=25),
            _run("bf16", "100mbit", step_ms=500, steps=100)]
    tta.add_projections(runs)
    stock, ef, bf16 = runs[2:]
    # Stock: the floor's 300 steps at its own 1000 ms.
    assert stock["projected_s"] == pytest.approx(300.0)
    assert ef["speedup_vs_stock"] == pytest.approx(300.0 / 15.0)
    assert ef["speedup_vs_stock_kind"] == "projected"
    # bf16 reached the target nowhere: no projection, no speed-up against it.
    assert "projected_s" not in bf16 and ef["speedup_vs_bf16"] is None
    assert stock["speedup_vs_stock"] == pytest.approx(1.0)


def test_target_from_the_floor_run_and_the_report():
    args = _args("--floor", "stock")
    runs = tta.plan(args, {})
    assert tta.target_for(args, runs, "mlp") is None  # not run yet
    runs[0].update(_run("stock", "10gbit", role="floor", reached_at=300), final_accuracy=0.88)
    assert tta.target_for(args, runs, "mlp") == pytest.approx(0.875)
    assert tta.target_for(_args("--target", "0.9"), runs, "mlp") == 0.9
    runs[1].update(_run("stock", "1gbit", reached_at=300, step_ms=200))
    runs[2].update(status="failed", reason="RuntimeError: boom")
    tta.add_projections(runs)
    report = {"runs": runs, "command": "python benchmarks/time_to_accuracy.py",
              "started": "now", "cpu_count": 2}
    text = tta.render(report, args)
    assert "target 0.8750" in text
    assert "| stock | stock fp32, momentum SGD (0.9) | 60 s | 1.00× |" in text
    assert "failed: RuntimeError: boom" in text


def test_resume_keeps_finished_runs_with_the_same_schedule():
    args = _args("--floor", "stock")
    first = tta.plan(args, {})
    done = {tta._key(first[0]): dict(first[0], status="ok", final_accuracy=0.9)}
    again = tta.plan(args, done)
    assert again[0]["status"] == "ok" and again[0]["final_accuracy"] == 0.9
    changed = tta.plan(_args("--floor", "stock", "--epochs", "5"), done)
    assert "status" not in changed[0]


@pytest.fixture
def global_seeds():
    """Puts back the global random states that Keras's ``set_random_seed`` sets."""
    import random

    import numpy as np
    import tensorflow as tf

    from tf_keras.src import backend

    python_state, numpy_state = random.getstate(), np.random.get_state()
    keras_seeds = getattr(backend._SEED_GENERATOR, "generator", None)
    yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    tf.random.set_seed(None)
    backend._SEED_GENERATOR.generator = keras_seeds


def test_mobilenetv2_is_keras_s_own_padded_to_32_with_faster_batch_norms_and_logits(
        global_seeds):
    import numpy as np
    import tf_keras as keras

    net = tta.build_mobilenetv2(keras, (28, 28, 1), 10, seed=0)
    assert net.input_shape == (None, 28, 28, 1)
    assert net.get_layer("pad_to_32").output_shape == (None, 32, 32, 1)
    norms = [layer for layer in net.layers
             if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 52 and {layer.momentum for layer in norms} == {0.99}
    # Logits, not a softmax: the loss takes from_logits.
    assert net.layers[-1].activation is keras.activations.linear
    x = np.random.RandomState(0).rand(4, 28, 28, 1).astype(np.float32)
    out = net(x, training=False).numpy()
    assert out.shape == (4, 10) and not np.allclose(out.sum(axis=1), 1.0, atol=1e-3)
    # Keras's own layers, seeded through its global seed.
    assert sum(int(np.prod(w.shape)) for w in net.trainable_weights) > 2_000_000
    again = tta.build_mobilenetv2(keras, (28, 28, 1), 10, seed=0)
    other = tta.build_mobilenetv2(keras, (28, 28, 1), 10, seed=1)
    w, w_again, w_other = (m.trainable_weights[0].numpy() for m in (net, again, other))
    np.testing.assert_array_equal(w, w_again)
    assert not np.array_equal(w, w_other)


def test_patch_tokens_are_each_patch_s_pixels_as_bits_row_by_row():
    import numpy as np

    images = np.zeros((3, 28, 28, 1), np.float32)
    images[0, 0, 0] = 1.0           # patch 0, pixel (0, 0): bit 0
    images[0, 5, 6] = 0.5           # patch (1, 1) = word 8, pixel (1, 2): bit 6
    images[1, 27, 27] = 0.31        # the last patch's last pixel: bit 15
    images[1, 27, 26] = 0.3         # at the threshold: not above it
    images[2] = 0.9                 # every pixel: every word all ones
    tokens = tta.patch_tokens(images)
    assert tokens.shape == (3, 49) and tokens.dtype == np.int32
    expected = np.zeros((3, 49), np.int32)
    expected[0, 0], expected[0, 8], expected[1, 48] = 1, 1 << 6, 1 << 15
    expected[2] = (1 << 16) - 1
    np.testing.assert_array_equal(tokens, expected)
    # A word depends on its own patch only, and every id is in the vocabulary.
    rng = np.random.default_rng(0)
    noise = rng.random((8, 28, 28, 1)).astype(np.float32)
    words = tta.patch_tokens(noise)
    assert words.min() >= 0 and words.max() < 1 << 16
    changed = noise.copy()
    changed[:, 4:8, 8:12] = 0.0     # patch (1, 2): word 9
    differs = (tta.patch_tokens(changed) != words).any(axis=0)
    assert differs[9] and differs.sum() == 1
    with pytest.raises(ValueError, match="patches"):
        tta.patch_tokens(np.zeros((1, 30, 28, 1), np.float32))


def test_encoder_reads_fashion_mnist_sentences_with_a_large_sparse_table(global_seeds):
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    models = benchmark_module("models")
    net = models.build_encoder(keras, vocab=1 << 16, seq_len=49, num_classes=10)
    assert net.input_shape == (None, 49) and net.output_shape == (None, 10)
    table = net.get_layer("token_embedding").embeddings
    assert table.shape == (65536, 128)
    tokens = tta.patch_tokens(np.random.default_rng(1).random((2, 28, 28, 1)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(net(tokens))
    grad = tape.gradient(loss, table)
    # The table's gradient is the touched rows, one per word, not a dense table.
    assert isinstance(grad, tf.IndexedSlices) and grad.values.shape == (98, 128)
