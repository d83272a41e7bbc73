"""LinearScalingWarmup (Goyal et al. 2017's linear scaling rule and gradual warm-up)
against its formula, and the trainer's path from flags to the optimizer's rate.

No cluster here: the worker count is an argument, as ``worker_info`` would give it.
"""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tfgc.apps import train
from tfgc.keras.schedules import LinearScalingWarmup, scaled_learning_rate


def formula(step, base, workers, warmup_steps):
    """The schedule as the docstring states it, in float64."""
    if step < warmup_steps:
        return base + (workers * base - base) * step / warmup_steps
    return workers * base


def value(schedule, step):
    return float(schedule(tf.constant(step, tf.int64)))


@pytest.mark.parametrize("base,workers,warmup", [(0.1, 8, 100), (0.05, 2, 30), (0.01, 3, 7)])
def test_values_follow_formula(base, workers, warmup):
    s = LinearScalingWarmup(base, workers, warmup)
    steps = [0, 1, warmup // 2, warmup - 1, warmup, warmup + 1, 10 * warmup]
    for step in steps:
        assert value(s, step) == pytest.approx(formula(step, base, workers, warmup), rel=1e-6)
    # Named points: η at step 0, halfway at W/2, N·η from step W on.
    assert value(s, 0) == pytest.approx(base, rel=1e-6)
    if warmup % 2 == 0:
        assert value(s, warmup // 2) == pytest.approx(base * (1 + workers) / 2, rel=1e-6)
    assert value(s, warmup) == pytest.approx(workers * base, rel=1e-6)
    assert value(s, 10 ** 7) == pytest.approx(workers * base, rel=1e-6)
    assert s.peak_learning_rate == pytest.approx(workers * base)


def test_paper_resnet50_numbers():
    # 0.1 per 256 images; 8k images = 32x: 3.2, reached from 0.1 over 5 epochs.
    steps_per_epoch = 1.28e6 // 8192
    s = LinearScalingWarmup(0.1, 32, int(5 * steps_per_epoch))
    assert value(s, 0) == pytest.approx(0.1, rel=1e-6)
    assert value(s, int(5 * steps_per_epoch)) == pytest.approx(3.2, rel=1e-6)


def test_one_worker_is_the_base_rate():
    s = LinearScalingWarmup(0.05, 1, 20)
    for step in (0, 1, 10, 19, 20, 1000):
        assert value(s, step) == pytest.approx(0.05, rel=1e-6)


def test_no_warmup_starts_at_scaled_rate():
    s = LinearScalingWarmup(0.05, 4, 0)
    for step in (0, 1, 1000):
        assert value(s, step) == pytest.approx(0.2, rel=1e-6)


def test_monotone_during_warmup():
    s = LinearScalingWarmup(0.1, 5, 50)
    got = np.array([value(s, t) for t in range(60)])
    assert np.all(np.diff(got[:51]) > 0)
    # Equal increments ("a constant amount at each iteration").
    np.testing.assert_allclose(np.diff(got[:51]), 0.4 / 50, rtol=1e-4)
    np.testing.assert_allclose(got[50:], 0.5, rtol=1e-6)


def test_after_schedule_takes_over_at_global_step():
    decay = keras.optimizers.schedules.PiecewiseConstantDecay([20, 30], [0.4, 0.04, 0.004])
    s = LinearScalingWarmup(0.1, 4, 10, after=decay)
    assert value(s, 5) == pytest.approx(0.25, rel=1e-6)
    assert value(s, 10) == pytest.approx(0.4, rel=1e-6)
    assert value(s, 25) == pytest.approx(0.04, rel=1e-6)
    assert value(s, 31) == pytest.approx(0.004, rel=1e-6)
    # A number is a constant after warm-up.
    c = LinearScalingWarmup(0.1, 4, 10, after=0.3)
    assert value(c, 9) == pytest.approx(0.1 + 0.3 * 9 / 10, rel=1e-6)
    assert value(c, 10) == pytest.approx(0.3, rel=1e-6)


def test_works_in_tf_function_with_int_and_float_steps():
    s = LinearScalingWarmup(0.1, 3, 4)
    f = tf.function(lambda t: s(t))
    assert float(f(tf.constant(2, tf.int64))) == pytest.approx(0.2, rel=1e-6)
    assert float(f(tf.constant(2.0))) == pytest.approx(0.2, rel=1e-6)
    assert s(tf.constant(0)).dtype == tf.float32


@pytest.mark.parametrize("kwargs,name", [
    (dict(base_learning_rate=0.0), "base_learning_rate"),
    (dict(base_learning_rate=-0.1), "base_learning_rate"),
    (dict(base_learning_rate=float("nan")), "base_learning_rate"),
    (dict(base_learning_rate="0.1"), "base_learning_rate"),
    (dict(base_learning_rate=True), "base_learning_rate"),
    (dict(workers=0), "workers"),
    (dict(workers=2.0), "workers"),
    (dict(workers=True), "workers"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(warmup_steps=2.5), "warmup_steps"),
    (dict(after="fast"), "after"),
    (dict(after=-1.0), "after"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    args = dict(base_learning_rate=0.1, workers=2, warmup_steps=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"`{name}`"):
        LinearScalingWarmup(**args)


def test_numpy_integers_are_accepted():
    s = LinearScalingWarmup(np.float32(0.1), np.int64(2), np.int32(4))
    assert s.workers == 2 and s.warmup_steps == 4
    assert value(s, 4) == pytest.approx(0.2, rel=1e-6)


def test_scaled_learning_rate():
    assert scaled_learning_rate(0.1, 32) == pytest.approx(3.2)
    assert scaled_learning_rate(0.05, 1) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="`workers`"):
        scaled_learning_rate(0.1, 0)
    with pytest.raises(ValueError, match="`base_learning_rate`"):
        scaled_learning_rate(0, 2)


@pytest.mark.parametrize("after", [None, 0.3, keras.optimizers.schedules.PiecewiseConstantDecay(
    [20], [0.4, 0.04])])
def test_config_round_trip(after):
    s = LinearScalingWarmup(0.1, 4, 10, after=after, name="warm")
    config = s.get_config()
    assert config["base_learning_rate"] == 0.1 and config["workers"] == 4
    assert config["warmup_steps"] == 10 and config["name"] == "warm"
    for again in (LinearScalingWarmup.from_config(config),
                  keras.optimizers.schedules.deserialize(
                      keras.optimizers.schedules.serialize(s))):
        assert isinstance(again, LinearScalingWarmup)
        assert again.get_config() == config
        for step in (0, 5, 10, 25):
            assert value(again, step) == pytest.approx(value(s, step), rel=1e-6)


def test_optimizer_config_round_trip():
    opt = keras.optimizers.SGD(LinearScalingWarmup(0.1, 4, 10), momentum=0.9)
    again = keras.optimizers.SGD.from_config(opt.get_config())
    assert isinstance(again._learning_rate, LinearScalingWarmup)
    assert again._learning_rate.get_config() == opt._learning_rate.get_config()


def run_steps(optimizer, steps, grad=1.0):
    """Applies the constant gradient ``grad`` to a scalar at 0; returns its values."""
    w = tf.Variable(0.0)
    values = []
    for _ in range(steps):
        optimizer.apply_gradients([(tf.constant(grad), w)])
        values.append(float(w.numpy()))
    return values


def test_sgd_applies_the_scheduled_rate():
    # Steps 0, 1, 2 of a 4-step ramp from 0.1 to 0.4: 0.1, 0.175, 0.25.
    opt = keras.optimizers.SGD(LinearScalingWarmup(0.1, 4, 4))
    got = run_steps(opt, 3, grad=2.0)
    np.testing.assert_allclose(got, [-0.2, -0.55, -1.05], rtol=1e-6)
    assert float(opt.learning_rate) == pytest.approx(0.25, rel=1e-6)
    # Then 0.325 and the constant 0.4.
    opt = keras.optimizers.SGD(LinearScalingWarmup(0.1, 4, 4))
    got = run_steps(opt, 6)
    np.testing.assert_allclose(np.diff([0.0] + got),
                               [-0.1, -0.175, -0.25, -0.325, -0.4, -0.4], rtol=1e-5)


def test_fit_uses_the_schedule_each_step():
    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rates = []

        def on_train_batch_end(self, batch, logs=None):
            self.rates.append(float(self.model.optimizer.learning_rate))

    net = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
    net.compile(optimizer=keras.optimizers.SGD(LinearScalingWarmup(0.01, 3, 4)), loss="mse")
    record = Record()
    x = np.ones((8, 3), np.float32)
    net.fit(x, np.zeros((8, 1), np.float32), batch_size=2, epochs=2, verbose=0,
            callbacks=[record])
    expected = [formula(t, 0.01, 3, 4) for t in range(8)]
    np.testing.assert_allclose(record.rates, expected, rtol=1e-5)


def test_checkpoint_resumes_the_schedule(tmp_path):
    opt = keras.optimizers.SGD(LinearScalingWarmup(0.1, 4, 10), momentum=0.9)
    w = tf.Variable(0.0)
    for _ in range(5):
        opt.apply_gradients([(tf.constant(1.0), w)])
    path = tf.train.Checkpoint(optimizer=opt, w=w).save(str(tmp_path / "ckpt"))

    restored = keras.optimizers.SGD(LinearScalingWarmup(0.1, 4, 10), momentum=0.9)
    w2 = tf.Variable(0.0)
    restored.build([w2])
    tf.train.Checkpoint(optimizer=restored, w=w2).restore(path).assert_consumed()
    assert int(restored.iterations) == 5
    restored.apply_gradients([(tf.constant(1.0), w2)])
    assert float(restored.learning_rate) == pytest.approx(formula(5, 0.1, 4, 10), rel=1e-6)


def test_exported_from_tfgc_keras():
    import tfgc.keras
    assert tfgc.keras.LinearScalingWarmup is LinearScalingWarmup
    assert "LinearScalingWarmup" in tfgc.keras.__all__


# The trainer: flags -> learning rate -> optimizer.

def test_warmup_steps_for():
    assert train.warmup_steps_for(0, 60) == 0
    assert train.warmup_steps_for(0.5, 60) == 30
    assert train.warmup_steps_for(5, 156) == 780
    assert train.warmup_steps_for(0.1, 30) == 3  # not 4 from 3.0000000000000004
    assert train.warmup_steps_for(0.001, 60) == 1  # a positive warm-up is at least a step
    with pytest.raises(ValueError, match="`warmup_epochs`"):
        train.warmup_steps_for(-1, 60)


def test_make_learning_rate():
    assert train.make_learning_rate(0.05) == 0.05
    assert train.make_learning_rate(0.05, "none", workers=4) == 0.05
    s = train.make_learning_rate(0.05, "linear", workers=4, warmup_steps=30)
    assert isinstance(s, LinearScalingWarmup)
    assert (s.base_learning_rate, s.workers, s.warmup_steps) == (0.05, 4, 30)
    assert s.peak_learning_rate == pytest.approx(0.2)
    with pytest.raises(ValueError, match="`warmup_steps`"):
        train.make_learning_rate(0.05, "none", workers=4, warmup_steps=30)
    with pytest.raises(ValueError, match="`lr_scaling`"):
        train.make_learning_rate(0.05, "sqrt", workers=4)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_make_optimizer_with_linear_scaling(name):
    opt = train.make_optimizer(name, 0.05, None, lr_scaling="linear", workers=2,
                               warmup_steps=30)
    assert isinstance(opt._learning_rate, LinearScalingWarmup)
    assert opt._learning_rate.get_config()["workers"] == 2
    # The old call without the keyword arguments is unchanged: a constant rate.
    plain = train.make_optimizer(name, 0.05)
    assert not isinstance(plain._learning_rate, LinearScalingWarmup)
    assert float(plain.learning_rate) == pytest.approx(0.05)


def test_make_optimizer_sgd_steps_with_scaling():
    opt = train.make_optimizer("sgd", 0.1, lr_scaling="linear", workers=4, warmup_steps=4)
    np.testing.assert_allclose(run_steps(opt, 3), [-0.1, -0.275, -0.525], rtol=1e-6)


def test_trainer_rejects_warmup_without_scaling():
    # Flag parsing fails before anything is imported or launched.
    proc = subprocess.run([sys.executable, "-m", "tfgc.apps.train", "--warmup_epochs=1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--warmup_epochs > 0 needs --lr_scaling=linear" in proc.stderr
