"""Variance-based compression (Tsuzuku, Imachi & Akiba 2018, arXiv 1802.06058).

An entry's update is delayed until it is unambiguous: large next to its own
uncertainty. Per worker and entry, with the per-sample second moment s of this
step's gradient g (``CompressContext.second_moment``, from ``tfgc.keras.MomentDense``):

    r <- r + g,   v <- v + s
    send r where r^2 > alpha * v; there r <- r - sent and v <- 0;
    elsewhere v <- zeta * v (r is kept whole).

s is (1/B^2) sum_z g_z^2, the variance of the minibatch mean when the per-sample
gradients have mean zero, so v sums the variances of everything r has accumulated
and the test reads "r is more than sqrt(alpha) standard errors from zero". What
was chosen where the paper could not be read here (the project's notes mark these
as recalled):

* v holds the variance of the *mean* (1/B^2 sum_z g_z^2), not the mean of the
  squares: with the latter, r^2 > alpha v would hardly ever hold at alpha ~ 1-2.
* Only v decays (zeta), and sending leaves the rounding error in r instead of
  zeroing it, so nothing is lost: sum of everything sent + r = sum of every g.
* The 4-bit encoding: a sign bit and a 3-bit exponent k, the value being
  sign * M * 2^-k with M the largest |r| sent in this message (one float per
  tensor) and k = round(log2(M / |r|)) clipped to [0, 7]; index and code share one
  32-bit word (index << 4 | code), so a tensor may hold at most 2^28 entries.
* Entries that pass vary in number from step to step while payloads have static
  shapes: at most ``max_density`` n are sent, the largest r^2 / v first (the
  rest stay in r and v).

Every worker picks its own entries, so payloads are all-gathered.
"""

import math

import tensorflow as tf

from tfgc.compressors.base import (Compressor, check_positive_float, check_ratio, checked_count,
                                   num_elements)
from tfgc.ops import sparsify

_INDEX_BITS = 28
_EXPONENT_LEVELS = 8


def _check_zeta(zeta):
    if isinstance(zeta, bool) or not isinstance(zeta, (int, float)) or not 0.0 <= zeta <= 1.0:
        raise ValueError(f"`zeta` must be a number in [0, 1], got {zeta!r}")
    return float(zeta)


class Variance(Compressor):
    """Variance-based compression (see the module docstring).

    Args:
      alpha: send r where r^2 > alpha * v; > 0, default 2 (the paper sweeps about
        1-2; larger sends less).
      zeta: decay of v for entries not sent, in [0, 1]. Default 0.999.
      max_density: capacity, at most this fraction of entries per step, in (0, 1].
        Default 0.01.

    Needs a model whose dense layers are ``tfgc.keras.MomentDense``; gradients of
    other layers go dense.

    Wire: 32 bits per entry of capacity, plus the scale M and a count word.
    """

    name = "variance"
    needs_second_moment = True

    def __init__(self, alpha: float = 2.0, zeta: float = 0.999, max_density: float = 0.01):
        self.alpha = check_positive_float("alpha", alpha)
        self.zeta = _check_zeta(zeta)
        self.max_density = check_ratio("max_density", max_density)

    def supports(self, shape, dtype):
        return super().supports(shape, dtype) and num_elements(shape) <= 2 ** _INDEX_BITS

    def capacity(self, shape) -> int:
        n = num_elements(shape)
        return min(n, max(1, int(math.ceil(self.max_density * n))))

    def init_state(self, shape, dtype):
        # "sent": how many entries the last step sent. Neither r nor v can tell:
        # a sent entry leaves v = 0, but so does a dead unit (and zeta = 0), and
        # an entry sent exactly (the largest, at exponent 0) leaves r = 0.
        return {"r": tf.zeros(shape, dtype), "v": tf.zeros(shape, dtype),
                "sent": tf.zeros([])}

    def diagnostics(self, state, step=None):
        """Per gradient: ``held_norm``, the l2 norm of r, what waits unsent, and
        ``send_rate``, the fraction of entries the last step sent (at most
        ``max_density``).
        """
        del step
        if state is None or "r" not in state:
            return {}
        out = {"held_norm": tf.norm(tf.cast(state["r"], tf.float32))}
        if "sent" in state:
            size = max(1, num_elements(state["r"].shape))
            out["send_rate"] = tf.convert_to_tensor(state["sent"]) / float(size)
        return out

    def compress(self, x, state, ctx):
        if ctx.second_moment is None:
            raise ValueError("variance compression needs the per-sample second moments: "
                             "build the model's dense layers with tfgc.keras.MomentDense")
        cap = self.capacity(x.shape)
        r = tf.reshape(state["r"] + x, [-1])
        v = tf.reshape(state["v"] + tf.cast(ctx.second_moment, x.dtype), [-1])
        r32, v32 = tf.cast(r, tf.float32), tf.cast(v, tf.float32)
        margin = tf.square(r32) - self.alpha * v32
        passing = tf.reshape(tf.where(tf.logical_and(margin > 0, r32 != 0)), [-1])
        passing = tf.cast(passing, tf.int32)

        def largest():
            # The entries most beyond the test: r^2 / v largest (v = 0 first).
            score = tf.math.divide_no_nan(tf.square(tf.gather(r32, passing)),
                                          tf.gather(v32, passing))
            score = tf.where(tf.gather(v32, passing) > 0, score, float("inf"))
            return tf.sort(tf.gather(passing, tf.math.top_k(score, cap, sorted=False).indices))

        sent = tf.cond(tf.shape(passing)[0] > cap, largest, lambda: passing)
        values = tf.gather(r32, sent)
        scale = tf.reduce_max(tf.concat([tf.abs(values), [0.0]], 0))
        exponent = tf.clip_by_value(
            tf.round(tf.math.log(tf.math.divide_no_nan(scale, tf.abs(values))) / math.log(2.0)),
            0, _EXPONENT_LEVELS - 1)
        exponent = tf.cast(exponent, tf.int32)
        negative = tf.cast(values < 0, tf.int32)
        code = tf.bitwise.bitwise_or(tf.bitwise.left_shift(negative, 3), exponent)
        words = tf.bitwise.bitwise_or(tf.bitwise.left_shift(sent, 4), code)
        decoded = self._values(code, scale)
        new_r = tf.tensor_scatter_nd_sub(r, sent[:, None], tf.cast(decoded, r.dtype))
        decayed = v * tf.cast(self.zeta, v.dtype)
        new_v = tf.tensor_scatter_nd_update(decayed, sent[:, None], tf.zeros_like(values, v.dtype))
        count = tf.shape(sent)[0]
        words = tf.ensure_shape(tf.concat([words, tf.zeros([cap - count], tf.int32)], 0), [cap])
        payload = (words, tf.reshape(scale, [1]), tf.reshape(count, [1]))
        return payload, {"r": tf.reshape(new_r, x.shape), "v": tf.reshape(new_v, x.shape),
                         "sent": tf.cast(count, tf.float32)}

    @staticmethod
    def _values(code, scale):
        magnitude = scale * tf.pow(2.0, -tf.cast(tf.bitwise.bitwise_and(code, 7), tf.float32))
        return tf.where(tf.bitwise.bitwise_and(code, 8) > 0, -magnitude, magnitude)

    def decompress(self, payload, shape, dtype, ctx):
        words, scale, count = payload
        words = words[:checked_count(count, self.capacity(shape))]
        index = tf.bitwise.right_shift(words, 4)
        values = self._values(tf.bitwise.bitwise_and(words, 15), tf.reshape(scale, []))
        # The kernel checks every index (a negative word gives a negative one).
        dense = sparsify.scatter_add_payloads(values, index, num_elements(shape))
        return tf.reshape(tf.cast(dense, dtype), shape)
