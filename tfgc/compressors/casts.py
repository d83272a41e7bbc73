"""Lossless and half-precision baselines: identity, fp16 and bf16.

All three are summable: their payload is the gradient itself (or a narrower copy),
so workers combine it with one dense all-reduce.
"""

import tensorflow as tf

from tfgc.compressors.base import Compressor


class Identity(Compressor):
    """Sends the gradient unchanged (32 bits per float32 element).

    Reduced through the same fused all-reduce as TensorFlow's own
    ``CollectiveAllReduce``, so training is bit-identical to the stock strategy.
    """

    name = "none"
    summable = True

    def compress(self, x, state, ctx):
        return (tf.reshape(x, [-1]),), state

    def decompress(self, payload, shape, dtype, ctx):
        return tf.reshape(tf.cast(payload[0], dtype), shape)


class _Cast(Compressor):
    summable = True
    wire_dtype = None

    def compress(self, x, state, ctx):
        return (tf.cast(tf.reshape(x, [-1]), self.wire_dtype),), state

    def decompress(self, payload, shape, dtype, ctx):
        return tf.reshape(tf.cast(payload[0], dtype), shape)


class FP16(_Cast):
    """Casts to IEEE half precision (16 bits per element) and all-reduces in fp16.

    Values beyond 65504 overflow to inf and those below about 6e-8 flush to zero,
    so use it with gradients of moderate scale (or loss scaling).
    """

    name = "fp16"
    wire_dtype = tf.float16


class BF16(_Cast):
    """Casts to bfloat16 (16 bits per element): float32's range, 8 bits of mantissa."""

    name = "bf16"
    wire_dtype = tf.bfloat16
