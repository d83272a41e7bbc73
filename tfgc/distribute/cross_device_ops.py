"""``CompressedAllReduce``: TensorFlow's collective all-reduce, with compression.

A gradient's trip through one reduction call:

  1. the policy splits the call's tensors into dense ones (small, 1-D, integer) and
     compressed ones;
  2. each compressed tensor is compressed with its own state (residuals, counters),
     read from and written back to per-replica variables;
  3. dense tensors and summable payloads go through one fused all-reduce per dtype;
     other payloads are packed into int32 words and exchanged by all-gather, a few
     tensors per collective;
  4. gathered payloads are decoded and combined in rank order (bit-identical on every
     worker), summable ones are decoded once after the sum;
  5. MEAN divides by the group size, as the stock implementation does.

All collectives go through the launchers of the parent class, so they share its
instance keys and ordering token.
"""

import copy
from typing import List

import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import reduce_util
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from tfgc import collectives
from tfgc.compressors import CompressContext, get as get_compressor
from tfgc.distribute.policy import CompressionPolicy
from tfgc.distribute.state import StateStore
from tfgc.distribute.stats import CompressionStats
from tfgc.ops import packing


def _nbytes(t) -> int:
    return int(t.shape.num_elements()) * t.dtype.size


def _payload_bytes(payload, gathered: bool) -> int:
    """Bytes a payload occupies on the wire (int32 words when gathered)."""
    if not gathered:
        return sum(_nbytes(p) for p in payload)
    return sum(4 * packing.num_words(int(p.shape.num_elements()), p.dtype) for p in payload)


def check_compression_args(compressor, policy, communication, bucket_bytes):
    """Validates the compression settings; returns ``(compressor, policy)`` built from them.

    Raises ``ValueError`` naming the offending argument.
    """
    compressor = get_compressor(compressor)
    policy = CompressionPolicy() if policy is None else policy
    if not isinstance(policy, CompressionPolicy):
        raise ValueError(f"`policy` must be a tfgc.CompressionPolicy, got {policy!r}")
    collectives.check_communication(communication, compressor)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"`bucket_bytes` must be a positive integer, got {bucket_bytes!r}")
    return compressor, policy


class CompressedAllReduce(cross_device_ops_lib.CollectiveAllReduce):
    """Cross-device ops that compress gradients on their way through collectives.

    Args:
      devices: local devices, as for ``CollectiveAllReduce``.
      group_size: total number of replicas in the cluster.
      options: ``tf.distribute.experimental.CommunicationOptions``.
      collective_keys: shared ``CollectiveKeys`` (from the strategy).
      compressor: a compressor, registry string or config dict.
      policy: a ``CompressionPolicy`` (default: compress tensors of rank >= 2 with
        at least 1024 elements).
      communication: "auto" (all-reduce for summable payloads, all-gather
        otherwise), "allreduce" (summable compressors only) or "allgather".
      bucket_bytes: upper bound on the per-worker size of one fused all-gather.
      worker_rank: index of this worker's first replica among all replicas; seeds
        per-worker randomness.
    """

    def __init__(self, devices, group_size, options, collective_keys=None,
                 canonicalize_devices=True, *, compressor="none", policy=None,
                 communication="auto", bucket_bytes=32 << 20, worker_rank=0):
        self._compressor, self._policy = check_compression_args(
            compressor, policy, communication, bucket_bytes)
        self._communication = communication
        self._bucket_bytes = bucket_bytes
        self._worker_rank = worker_rank
        super().__init__(devices, group_size, options, collective_keys, canonicalize_devices)
        self._state = StateStore()
        self._stats = CompressionStats(self._devices[0])

    # -- public --------------------------------------------------------------------

    @property
    def compressor(self):
        return self._compressor

    @compressor.setter
    def compressor(self, value):
        """Switches compressor; takes effect when a reduction is next traced.

        State is kept per compressor, so switching back resumes its residuals.
        """
        compressor = get_compressor(value)
        collectives.check_communication(self._communication, compressor)
        self._compressor = compressor

    @property
    def policy(self):
        return self._policy

    @property
    def state(self) -> StateStore:
        return self._state

    @property
    def stats(self) -> CompressionStats:
        return self._stats

    def _use_allreduce(self) -> bool:
        if self._communication == "auto":
            return self._compressor.summable
        return self._communication == "allreduce"

    # -- CrossDeviceOps ------------------------------------------------------------

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        """As the parent, but a lone replica's gradients still pass the compressor.

        The stock implementation returns the values of a single-worker,
        single-device strategy untouched. Compressing them anyway (over a collective
        group of one) lets a one-machine run show the accuracy and the byte figures
        that the compressor gives on a cluster.
        """
        if self._group_size == 1 and value_destination_pairs:
            if options is None:
                options = collective_util.Options()
            pairs = value_destination_pairs
            if not cross_device_ops_lib._validate_value_destination_pairs(pairs):  # pylint: disable=protected-access
                pairs = cross_device_ops_lib._normalize_value_destination_pairs(pairs)  # pylint: disable=protected-access
            return self.batch_reduce_implementation(reduce_op, pairs, options)
        return super().batch_reduce(reduce_op, value_destination_pairs, options)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        """Replica-context all-reduce; also reached by batch_reduce_implementation."""
        flat = nest.flatten(value)
        is_slices = [isinstance(v, indexed_slices.IndexedSlices) for v in flat]
        tensor_pos = [i for i, s in enumerate(is_slices) if not s]
        tensors = [ops.convert_to_tensor(flat[i]) for i in tensor_pos]
        compress_mask = [self._policy.should_compress(t, self._compressor) for t in tensors]
        if not any(compress_mask):
            # Nothing worth compressing (metrics, biases only): the stock path.
            return super()._all_reduce(reduce_op, value, replica_id, options)

        results = [None] * len(flat)
        reduced = self._compressed_reduce(tensors, compress_mask, replica_id, options)
        if reduce_op == reduce_util.ReduceOp.MEAN:
            with ops.device(self._devices[replica_id]):
                reduced = [r / tf.cast(self._group_size, r.dtype) for r in reduced]
        for i, r in zip(tensor_pos, reduced):
            results[i] = r
        slices_pos = [i for i, s in enumerate(is_slices) if s]
        if slices_pos:
            # Embedding gradients (IndexedSlices) keep the stock gather-based path.
            reduced_slices = super()._all_reduce(reduce_op, [flat[i] for i in slices_pos],
                                                 replica_id, options)
            for i, r in zip(slices_pos, reduced_slices):
                results[i] = r
        return nest.pack_sequence_as(value, results)

    def _compressed_reduce(self, tensors: List[tf.Tensor], compress_mask, replica_id, options):
        launcher = self._launchers[replica_id]
        options = self._options.merge(options)
        device = self._devices[replica_id]
        compressor = self._compressor
        num_local = len(self._devices)
        # State is keyed by compressor, call-site signature and position: a retrace
        # of the same model finds the same variables.
        signature = (repr(compressor),) + tuple((tuple(t.shape.as_list()), t.dtype.name)
                                                for t, m in zip(tensors, compress_mask) if m)
        rank = self._worker_rank + replica_id

        with ops.device(device):
            step_var = self._state.get((replica_id, signature, "step"), device,
                                       lambda: tf.constant(0, tf.int64))
            step = step_var.read_value()

            # 1. Compress, reading and writing each gradient's state.
            payloads, contexts, comp_index = {}, {}, 0
            for i, (t, m) in enumerate(zip(tensors, compress_mask)):
                if not m:
                    continue
                ctx = CompressContext(rank=rank, num_workers=self._group_size,
                                      index=comp_index, step=step)
                slot = self._state.get((replica_id, signature, comp_index), device,
                                       lambda t=t: compressor.init_state(t.shape, t.dtype))
                state = tf.nest.map_structure(lambda v: v.read_value(), slot)
                payload, new_state = compressor.compress(t, state, ctx)
                tf.nest.map_structure(lambda v, s: v.assign(s), slot, new_state)
                payloads[i], contexts[i] = tuple(payload), ctx
                comp_index += 1
            step_var.assign_add(1)

            # 2. Communicate: one fused all-reduce (per dtype) for dense tensors and
            #    summable payloads, fused all-gathers for the other payloads.
            use_allreduce = self._use_allreduce()
            to_reduce = []
            for i, t in enumerate(tensors):
                if i not in payloads:
                    to_reduce.append((i, t))
                elif use_allreduce:
                    if len(payloads[i]) != 1:
                        raise ValueError(f"{compressor!r} is summable, so its payload must be "
                                         f"one tensor, got {len(payloads[i])}")
                    to_reduce.append((i, payloads[i][0]))
            # Reversed, as the stock implementation packs, so identity matches it bit for bit.
            reduced = collectives.fused_all_reduce(launcher, [t for _, t in to_reduce][::-1],
                                                   options)[::-1]
            reduced = {i: r for (i, _), r in zip(to_reduce, reduced)}
            gathered = {}
            if not use_allreduce:
                order = sorted(payloads)
                exchanged = collectives.gather_payloads(
                    launcher, [payloads[i] for i in order], self._group_size, options,
                    self._bucket_bytes)
                gathered = dict(zip(order, exchanged))

            # 3. Decode and combine.
            outputs = []
            for i, t in enumerate(tensors):
                if i not in payloads:
                    outputs.append(reduced[i])
                elif use_allreduce:
                    outputs.append(compressor.decompress((reduced[i],), t.shape, t.dtype, contexts[i]))
                else:
                    outputs.append(compressor.aggregate(gathered[i], t.shape, t.dtype, contexts[i]))

            if replica_id == 0:
                dense_bytes = sum(_nbytes(t) for t in tensors)
                sent_bytes = sum(
                    _nbytes(t) if i not in payloads
                    else _payload_bytes(payloads[i], gathered=not use_allreduce)
                    for i, t in enumerate(tensors))
                self._stats.record(dense_bytes, sent_bytes)
                if not tf.executing_eagerly():
                    logging.log_first_n(
                        logging.INFO,
                        "tfgc: %d of %d tensors compressed with %r over %s, %d -> %d bytes per "
                        "worker per step (%d local replica(s))", 4,
                        sum(compress_mask), len(tensors), compressor,
                        "all-reduce" if use_allreduce else "all-gather", dense_bytes, sent_bytes,
                        num_local)
        return outputs

    # -- copying -------------------------------------------------------------------

    def __deepcopy__(self, memo):
        # distribute_coordinator deep-copies strategies; keep the class and settings.
        return CompressedAllReduce(
            self._devices, self._group_size, self._options,
            copy.deepcopy(self._collective_keys, memo), self._canonicalize_devices,
            compressor=self._compressor, policy=self._policy,
            communication=self._communication, bucket_bytes=self._bucket_bytes,
            worker_rank=self._worker_rank)

