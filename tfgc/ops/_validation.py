"""Argument validation shared by the op wrappers in ``tfgc.ops``.

Every public op function validates its arguments the same way whether it runs
the compiled kernel or the pure-TF reference, so that a bad argument (or a
malformed payload from another worker) fails with ``InvalidArgumentError`` at
the earliest point, with a message that names the argument. Type errors in
what the caller chose (a non-float gradient) are ``TypeError``.
"""

import numpy as np
import tensorflow as tf

FLOAT_DTYPES = (tf.float32, tf.float16, tf.bfloat16)


def invalid(message):
    raise tf.errors.InvalidArgumentError(None, None, message)


class Checks:
    """Run-time argument checks that fail with InvalidArgumentError.

    A condition known now (always the case in eager mode) raises immediately;
    one only known when a graph runs becomes a tf.debugging.Assert, which the
    caller must put in front of the computation via ``self.asserts``.
    """

    def __init__(self):
        self.asserts = []

    def require(self, cond, message):
        value = tf.get_static_value(cond) if tf.is_tensor(cond) else cond
        if value is not None:
            if not bool(np.all(value)):
                invalid(message)
            return
        self.asserts.append(tf.debugging.Assert(cond, [message]))

    def require_rank(self, t, rank, name):
        message = f"{name} must have rank {rank}"
        if t.shape.rank is not None:
            self.require(t.shape.rank == rank, f"{message}, got shape {t.shape}")
        else:
            self.require(tf.equal(tf.rank(t), rank), message)


def float_dtype(dtype, name="dtype"):
    dtype = tf.as_dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be one of float32, float16, bfloat16; got {dtype.name}")
    return dtype


def float_input(x):
    x = tf.convert_to_tensor(x)
    float_dtype(x.dtype, "x.dtype")
    return x


def to_tensor(value, dtype_hint):
    """convert_to_tensor that never casts typed inputs.

    dtype_hint is only applied to Python scalars and lists; a NumPy array or
    tensor keeps its own dtype (convert_to_tensor would otherwise silently cast
    e.g. a float32 array to the int32 hint).
    """
    if tf.is_tensor(value) or isinstance(value, (np.ndarray, np.generic)):
        return tf.convert_to_tensor(value)
    return tf.convert_to_tensor(value, dtype_hint=dtype_hint)


def _require_scalar(t, name):
    if t.shape.rank is not None and t.shape.rank != 0:
        invalid(f"{name} must be a scalar, got shape {t.shape}")
    return t


def int64_scalar(value, name):
    """A size or count argument as an int64 tensor; any failure is InvalidArgument.

    A rank that is only known when a graph runs is left to ``Checks.require_rank``.
    """
    try:
        t = to_tensor(value, tf.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        invalid(f"{name} must be an int64 scalar: {exc}")
    if t.dtype not in (tf.int32, tf.int64):
        invalid(f"{name} must be an integer, got {t.dtype.name}")
    return _require_scalar(tf.cast(t, tf.int64), name)


def float32_scalar(value, name):
    """A threshold or value argument as a float32 tensor.

    Python numbers and any float or integer tensor are accepted and converted:
    these are parameters chosen by the caller, not payload bytes.
    """
    try:
        if isinstance(value, float):
            # Through NumPy: TensorFlow's eager cache of Python scalar
            # constants treats -0.0 and 0.0 as the same key.
            value = np.float32(value)
        t = to_tensor(value, tf.float32)
    except (TypeError, ValueError, OverflowError) as exc:
        invalid(f"{name} must be a float32 scalar: {exc}")
    if not (t.dtype.is_floating or t.dtype.is_integer):
        invalid(f"{name} must be a number, got {t.dtype.name}")
    return _require_scalar(tf.cast(t, tf.float32), name)


def typed_tensor(value, dtype, name):
    """A payload tensor that must already have ``dtype`` (no silent casts)."""
    try:
        t = to_tensor(value, dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        invalid(f"{name} must be a {dtype.name} tensor: {exc}")
    if t.dtype != dtype:
        invalid(f"{name} must be {dtype.name}, got {t.dtype.name}")
    return t


def float_tensor(value, name, dtype=None):
    """A float32/float16/bfloat16 tensor, optionally of exactly ``dtype``."""
    try:
        t = to_tensor(value, dtype or tf.float32)
    except (TypeError, ValueError) as exc:
        invalid(f"{name} must be a float tensor: {exc}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16; got {t.dtype.name}")
    if dtype is not None and t.dtype != dtype:
        invalid(f"{name} must have dtype {dtype.name}, got {t.dtype.name}")
    return t
