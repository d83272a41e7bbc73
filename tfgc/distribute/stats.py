"""Per-step communication statistics: what a worker really puts on the wire.

Figures per worker and per gradient reduction:

* ``dense_bytes``: the gradients as they are (uncompressed);
* ``payload_bytes``: what this worker encodes: compressed payloads, plus the
  gradients sent dense and the few control words;
* ``sent_bytes`` / ``received_bytes``: what crosses this worker's link for the
  algorithm used. TensorFlow's CPU collectives are rings: an all-reduce of B bytes
  sends and receives 2(N-1)/N * B per worker (reduce-scatter, then all-gather), an
  all-gather of P bytes per worker sends and receives (N-1) * P;
* ``dense_sent_bytes``: what the stock dense ring all-reduce of the same gradients
  would send, 2(N-1)/N * dense_bytes, the figure to compare ``sent_bytes`` with;
* ``uncompressed_tensors`` / ``uncompressed_bytes``: the gradients of the last
  reduction sent as they are (small, 1-D, float64, a shape the compressor declines,
  identity, embedding rows on the stock gather, too few elements for the
  reduce-scatter), and their bytes; ``CompressedAllReduce.uncompressed_gradients()``
  names each with its reason.

``ratio`` is dense_bytes / payload_bytes (the compression of the payload) and
``wire_ratio`` is dense_sent_bytes / sent_bytes (the saving on the wire; 0 for a
single worker, which sends nothing). Embedding gradients (IndexedSlices) stand for
their whole table in ``dense_bytes``; the rows a step sends are known only at run
time and counted then: on the stock gather with this worker's own size standing in for
every worker's, as compressed rows with the padded size every worker sends.
"""

import threading

import tensorflow as tf
from absl import logging
from tensorflow.python.ops import resource_variable_ops

_BYTE_FIELDS = ("dense_bytes", "payload_bytes", "sent_bytes", "received_bytes",
                "dense_sent_bytes")
_FIELDS = (("steps", "nonfinite_steps") + _BYTE_FIELDS + tuple(f"total_{f}" for f in _BYTE_FIELDS)
           + ("uncompressed_tensors", "uncompressed_bytes"))


class WireBytes:
    """Adds up one reduction's figures while it is being built."""

    def __init__(self, num_workers: int):
        self.n = num_workers
        self.dense = 0
        self.payload = 0
        self.allreduce_bytes = 0
        self.gather_bytes = 0
        self.pairwise_bytes = 0  # sent by pairwise exchanges of static size
        self.dynamic = []  # payload bytes of IndexedSlices, gathered by the stock path
        self.dynamic_sent = []  # bytes sent by exchanges whose sizes are known at run time
        self.dynamic_payload = []  # payload bytes known at run time, already counted in sent
        self.dynamic_allreduce = []  # bytes of dense tensors whose static shape is unknown
        # The gradients sent as they are: (variable name, bytes, why), bytes an int or
        # an int64 tensor.
        self.uncompressed = []

    def uncompressed_gradient(self, name: str, nbytes, reason: str):
        """A gradient sent as it is (its bytes counted where it is sent), and why."""
        self.uncompressed.append((name, nbytes, reason))

    def uncompressed_reasons(self) -> str:
        """``"reason (count), ..."`` over the gradients sent as they are."""
        counts = {}
        for _, _, reason in self.uncompressed:
            counts[reason] = counts.get(reason, 0) + 1
        return ", ".join(f"{reason} ({count})" for reason, count in counts.items())

    def ring_allreduce(self, nbytes):
        """What a ring all-reduce of ``nbytes`` (an int or an int64 tensor) sends per worker."""
        return 2 * (self.n - 1) * nbytes // self.n

    def allreduce(self, payload: int, dense: int = 0):
        """``payload`` bytes all-reduced, standing for ``dense`` bytes of gradients.

        A dense tensor whose static shape is unknown passes its bytes as a tensor
        (``payload`` and ``dense`` the same): counted at run time.
        """
        if tf.is_tensor(payload):
            self.dynamic_allreduce.append(tf.cast(payload, tf.int64))
            return
        self.dense += dense
        self.payload += payload
        self.allreduce_bytes += payload

    def gather(self, payload: int, dense: int = 0):
        """``payload`` bytes all-gathered, standing for ``dense`` bytes of gradients."""
        self.dense += dense
        self.payload += payload
        self.gather_bytes += payload

    def pairwise(self, payload: int, dense: int, sent: int):
        """``payload`` bytes encoded for pairwise exchanges that send ``sent`` bytes in all."""
        self.dense += dense
        self.payload += payload
        self.pairwise_bytes += sent

    def exchanged(self, payload: int, dense: int, sent):
        """A payload that left through pairwise exchanges, ``sent`` bytes in all (a tensor)."""
        self.dense += dense
        self.payload += payload
        self.dynamic_sent.append(tf.cast(sent, tf.int64))

    def at_run_time(self, dense: int, payload, sent):
        """Bytes known only at run time (a stage chosen by step, embedding rows):
        ``payload`` encoded and ``sent`` on the wire (int64 tensors), standing for
        ``dense`` bytes of gradients."""
        self.dense += dense
        self.dynamic_payload.append(payload)
        self.dynamic_sent.append(sent)

    def indexed_slices(self, slices, dense_nbytes: int):
        values = tf.cast(tf.size(slices.values, out_type=tf.int64), tf.int64) * slices.values.dtype.size
        indices = tf.cast(tf.size(slices.indices, out_type=tf.int64), tf.int64) * slices.indices.dtype.size
        self.dense += dense_nbytes
        self.dynamic.append(values + indices)

    def log_trace(self, compressed: int, total: int, compressor, path: str):
        """Logs (a few times) what a traced reduction sends, per worker and step."""
        if self.uncompressed:
            logging.log_first_n(logging.INFO, "tfgc: %d gradients sent uncompressed: %s", 4,
                                len(self.uncompressed), self.uncompressed_reasons())
        if self.dynamic_payload or self.dynamic or self.dynamic_allreduce:
            logging.log_first_n(
                logging.INFO, "tfgc: %d of %d gradients compressed with %r over %s; per "
                "worker and step: %d bytes of gradients, payload sizes known at run time "
                "(stages by step, embedding rows)", 4, compressed, total, compressor, path,
                self.dense)
        else:
            logging.log_first_n(
                logging.INFO, "tfgc: %d of %d gradients compressed with %r over %s; per worker "
                "and step: %d bytes of gradients, %d bytes of payload, %d sent (a dense ring "
                "all-reduce sends %d)", 4, compressed, total, compressor, path, self.dense,
                self.payload, self.static_sent, self.dense_sent)

    @property
    def static_sent(self) -> int:
        return (self.ring_allreduce(self.allreduce_bytes) + (self.n - 1) * self.gather_bytes
                + self.pairwise_bytes)

    @property
    def dense_sent(self) -> int:
        return self.ring_allreduce(self.dense)


class CompressionStats:
    """The figures above for the last gradient reduction, and totals since creation."""

    def __init__(self, device="/device:CPU:0"):
        self._device = device
        self._vars = None
        self._lock = threading.Lock()

    def _variables(self):
        with self._lock:
            if self._vars is None:
                with tf.init_scope(), tf.device(self._device):
                    self._vars = {
                        f: resource_variable_ops.ResourceVariable(
                            tf.constant(0, tf.int64), trainable=False, name=f"tfgc_{f}")
                        for f in _FIELDS}
            return self._vars

    def record(self, wire: WireBytes, ok=None):
        """Adds one reduction's figures; ``ok`` is False when its step was skipped."""
        v = self._variables()
        with tf.device(self._device):
            dynamic = tf.add_n(wire.dynamic) if wire.dynamic else tf.constant(0, tf.int64)
            exchanged = tf.add_n(wire.dynamic_sent) if wire.dynamic_sent \
                else tf.constant(0, tf.int64)
            unknown = tf.add_n(wire.dynamic_allreduce) if wire.dynamic_allreduce \
                else tf.constant(0, tf.int64)
            sent = wire.static_sent + (wire.n - 1) * dynamic + exchanged + wire.ring_allreduce(unknown)
            values = {
                "dense_bytes": wire.dense + unknown,
                "payload_bytes": wire.payload + dynamic + unknown + (
                    tf.add_n(wire.dynamic_payload) if wire.dynamic_payload else 0),
                # Every exchange is symmetric: a worker receives what it sends.
                "sent_bytes": sent,
                "received_bytes": sent,
                "dense_sent_bytes": wire.dense_sent + wire.ring_allreduce(unknown),
            }
            uncompressed = [b for _, b, _ in wire.uncompressed]
            updates = [v["steps"].assign_add(1),
                       v["uncompressed_tensors"].assign(len(uncompressed)),
                       v["uncompressed_bytes"].assign(
                           tf.add_n([tf.cast(b, tf.int64) for b in uncompressed])
                           if uncompressed else tf.constant(0, tf.int64))]
            if ok is not None:
                updates.append(v["nonfinite_steps"].assign_add(1 - tf.cast(ok, tf.int64)))
            for f, value in values.items():
                updates.append(v[f].assign(value))
                updates.append(v[f"total_{f}"].assign_add(value))
            return tf.group(*updates)

    def record_skipped(self, skipped):
        """Counts a step that every worker skipped before its gradients were reduced
        (``skipped``, a boolean tensor; Keras 3's loss scaling decides before the
        all-reduce, ``keras_hooks``) in ``steps`` and ``nonfinite_steps``, as a step that
        tfgc's reduction skipped counts. Nothing was sent: the last reduction's figures
        stay."""
        v = self._variables()
        with tf.device(self._device):
            count = tf.cast(skipped, tf.int64)
            return tf.group(v["steps"].assign_add(count),
                            v["nonfinite_steps"].assign_add(count))

    def result(self):
        """A dict of Python numbers: the fields above plus ``ratio`` and ``wire_ratio``."""
        values = {f: int(var.numpy()) for f, var in self._variables().items()}
        values["ratio"] = (values["dense_bytes"] / values["payload_bytes"]) \
            if values["payload_bytes"] else 0.0
        values["wire_ratio"] = (values["dense_sent_bytes"] / values["sent_bytes"]) \
            if values["sent_bytes"] else 0.0
        return values

    def reset(self):
        for var in self._variables().values():
            var.assign(0)
