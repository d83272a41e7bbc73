"""Learning-rate schedules for data-parallel training on N workers.

Source: P. Goyal, P. Dollár, R. Girshick, P. Noordhuis, L. Wesolowski, A. Kyrola,
A. Tulloch, Y. Jia, K. He, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
arXiv:1706.02677 (2017). What this module takes from it:

* Linear scaling rule (their §2.1): when the minibatch grows k times, the learning
  rate grows k times, all other hyper-parameters unchanged. With a fixed per-worker
  batch n, N workers make a global batch of N·n, so the rate for N workers is
  N times the rate tuned for one worker's batch.
* Gradual warm-up (their §2.2): early in training the rule breaks down, so the run
  starts at the small-batch rate η and adds the same amount each iteration until it
  reaches k·η after 5 epochs (they report results are robust to the exact length);
  after that the usual schedule takes over. A constant low rate for the warm-up
  instead made the training error spike when it ended (their Table 1).
* Their ResNet-50 recipe (§5.1, §5.2): reference rate 0.1 for a minibatch of 256
  (8 workers × 32 images), i.e. η = 0.1·kn/256; at kn = 8192 that is 3.2, reached
  by gradual warm-up from 0.1 over 5 epochs, then divided by 10 at epochs 30, 60
  and 80 of 90.
"""

import math
import numbers

import tensorflow as tf
import tf_keras as keras


def _check_base(base_learning_rate):
    if (isinstance(base_learning_rate, bool)
            or not isinstance(base_learning_rate, numbers.Real)
            or not math.isfinite(base_learning_rate) or base_learning_rate <= 0):
        raise ValueError("`base_learning_rate` must be a finite number > 0, "
                         f"got {base_learning_rate!r}")
    return float(base_learning_rate)


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    return int(value)


def scaled_learning_rate(base_learning_rate, workers):
    """``workers * base_learning_rate``: the linear scaling rule of Goyal et al. 2017 (§2.1).

    ``base_learning_rate`` is the rate tuned for one worker's batch; with the per-worker
    batch fixed, ``workers`` workers train on a global batch ``workers`` times larger.
    """
    return _check_int("workers", workers, 1) * _check_base(base_learning_rate)


@keras.saving.register_keras_serializable(package="tfgc")
class LinearScalingWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Linear scaling of the learning rate with the worker count, after a gradual warm-up.

    With ``η = base_learning_rate``, ``N = workers`` and ``W = warmup_steps``, the rate
    at optimizer step ``t`` (``optimizer.iterations``, counted from 0) is::

        t <  W:  η + (N·η − η) · t / W     # ramps linearly from η ...
        t >= W:  after(t)                  # ... to N·η, then hands over to ``after``

    ``after`` defaults to the constant ``N·η``, so the rate reaches ``N·η`` exactly at
    step ``W`` and stays there. With ``workers=1`` the rate is ``η`` throughout; with
    ``warmup_steps=0`` it is ``after`` (by default ``N·η``) from the first step.

    This is the rule of Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet
    in 1 Hour" (arXiv:1706.02677, 2017): the linear scaling rule (§2.1: multiply the
    rate by k when the minibatch grows k times) and the gradual warm-up (§2.2: start at
    η, add a constant amount each iteration, reach k·η after 5 epochs). Their ResNet-50
    runs use η = 0.1 per 256 images (§5.1). ``warmup_steps`` is in optimizer steps:
    five epochs are ``5 * steps_per_epoch``, where an epoch is one pass of all N
    workers over the data.

    ``after`` is the schedule once warm-up ends: ``None`` (the constant ``N·η``), a
    number (a constant rate), or any ``LearningRateSchedule``. A schedule is called
    with the global step ``t``, not ``t − W``, as the paper counts its decay epochs
    from the start of training; its values are used as they are (not multiplied by
    N), so give it the scaled rates. The paper's step decay for a run of
    ``steps_per_epoch`` steps per epoch, for example::

        peak = scaled_learning_rate(0.1, workers)
        decay = keras.optimizers.schedules.PiecewiseConstantDecay(
            [30 * steps_per_epoch, 60 * steps_per_epoch, 80 * steps_per_epoch],
            [peak, peak / 10, peak / 100, peak / 1000])
        lr = LinearScalingWarmup(0.1, workers, 5 * steps_per_epoch, after=decay)

    As a ``LearningRateSchedule`` it is a function of ``optimizer.iterations`` alone:
    it is saved and restored with the optimizer (checkpoints, ``BackupAndRestore``)
    and every replica of a ``tf.distribute`` strategy computes the same rate.

    Momentum: the paper's Remark 2 asks for a momentum correction (scaling the
    velocity by η_{t+1}/η_t) when the rate changes and the velocity already includes
    it, as in Keras ``SGD(momentum=...)``. Keras does not apply it; during a gradual
    warm-up the step-to-step ratio is close to 1, so the effect is small, but a
    sudden jump (``after`` starting well above ``N·η``, or ``warmup_steps=0`` with a
    large N) is not corrected.
    """

    def __init__(self, base_learning_rate, workers, warmup_steps, after=None, name=None):
        super().__init__()
        self.base_learning_rate = _check_base(base_learning_rate)
        self.workers = _check_int("workers", workers, 1)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        if isinstance(after, dict):
            after = keras.optimizers.schedules.deserialize(after)
        if after is not None and not isinstance(
                after, keras.optimizers.schedules.LearningRateSchedule):
            if (isinstance(after, bool) or not isinstance(after, numbers.Real)
                    or not math.isfinite(after) or after < 0):
                raise ValueError("`after` must be None, a finite number >= 0 or a "
                                 f"keras LearningRateSchedule, got {after!r}")
            after = float(after)
        self.after = after
        self.name = name

    @property
    def peak_learning_rate(self):
        """``workers * base_learning_rate``: the rate at the end of warm-up."""
        return self.workers * self.base_learning_rate

    def __call__(self, step):
        with tf.name_scope(self.name or "LinearScalingWarmup"):
            given = tf.convert_to_tensor(step)
            step = tf.cast(given, tf.float32)
            if isinstance(self.after, keras.optimizers.schedules.LearningRateSchedule):
                after = tf.cast(self.after(given), tf.float32)
            else:
                value = self.peak_learning_rate if self.after is None else self.after
                after = tf.constant(value, tf.float32)
            if self.warmup_steps == 0:
                return after
            base = tf.constant(self.base_learning_rate, tf.float32)
            peak = tf.constant(self.peak_learning_rate, tf.float32)
            fraction = tf.minimum(step, float(self.warmup_steps)) / float(self.warmup_steps)
            warm = base + (peak - base) * fraction
            return tf.where(step < float(self.warmup_steps), warm, after)

    def get_config(self):
        after = self.after
        if isinstance(after, keras.optimizers.schedules.LearningRateSchedule):
            after = keras.optimizers.schedules.serialize(after)
        return {"base_learning_rate": self.base_learning_rate, "workers": self.workers,
                "warmup_steps": self.warmup_steps, "after": after, "name": self.name}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
