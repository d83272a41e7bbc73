"""Per-step communication statistics, readable from Python and from Keras logs."""

import threading

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops

_FIELDS = ("steps", "dense_bytes", "sent_bytes", "total_dense_bytes", "total_sent_bytes")


class CompressionStats:
    """Bytes each worker contributes per gradient reduction.

    ``dense_bytes`` is what the uncompressed gradients of the last reduction take,
    ``sent_bytes`` what this worker actually handed to the collectives for them
    (dense tensors plus compressed payloads), and ``ratio`` their quotient. Totals
    accumulate over all reductions since the strategy was created.
    """

    def __init__(self, device="/device:CPU:0"):
        self._device = device
        self._vars = None
        self._lock = threading.Lock()

    def _variables(self):
        with self._lock:
            if self._vars is None:
                with ops.init_scope(), ops.device(self._device):
                    self._vars = {
                        f: resource_variable_ops.ResourceVariable(
                            tf.constant(0, tf.int64), trainable=False, name=f"tfgc_{f}")
                        for f in _FIELDS}
            return self._vars

    def record(self, dense_bytes: int, sent_bytes: int):
        """Adds one reduction's figures (Python ints known when the graph is built)."""
        v = self._variables()
        with ops.device(self._device):
            return tf.group(
                v["steps"].assign_add(1),
                v["dense_bytes"].assign(dense_bytes),
                v["sent_bytes"].assign(sent_bytes),
                v["total_dense_bytes"].assign_add(dense_bytes),
                v["total_sent_bytes"].assign_add(sent_bytes))

    def result(self):
        """A dict of Python numbers: the fields above plus ``ratio``."""
        values = {f: int(var.numpy()) for f, var in self._variables().items()}
        values["ratio"] = (values["dense_bytes"] / values["sent_bytes"]) if values["sent_bytes"] else 0.0
        return values

    def reset(self):
        for var in self._variables().values():
            var.assign(0)
