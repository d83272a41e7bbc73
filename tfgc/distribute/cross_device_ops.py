"""``CompressedAllReduce``: TensorFlow's collective all-reduce, with compression.

Only gradient aggregations are compressed: a reduction is one when it runs inside a
``tfgc.compress_gradients`` context whose variables match its values (Keras
optimizers open it by themselves, see ``keras_hooks``). Everything else (metrics,
batch-norm statistics, a user's own ``all_reduce``, ``strategy.reduce``) takes the
stock exact path.

A gradient aggregation, step by step:

  1. the policy splits the gradients into dense ones (small, 1-D, integer,
     float64, IndexedSlices) and compressed ones;
  2. each compressed gradient is compressed with its variable's state, read from
     the owner's ``CompressionState``; nothing is written yet;
  3. dense tensors and summable payloads go through one fused all-reduce per dtype,
     other payloads are packed into int32 words and all-gathered, a few tensors per
     collective. A few *control* words ride along: whether this worker's gradients
     were all finite, and its step counter;
  4. if every worker's gradients were finite, the payloads are decoded and
     combined in rank order (bit-identical on every worker) and the new state is
     written; otherwise the compressed gradients come out as NaN on every worker
     (so a ``LossScaleOptimizer`` skips the step) and the state stays as it was;
  5. MEAN divides by the group size, as the stock implementation does.

All collectives go through the launchers of the parent class, so they share its
instance keys and ordering token. Before the first compressed reduction of each
compressor, the workers exchange their settings and stop with a message naming
both if they differ.
"""

import copy
import hashlib
import threading
import weakref
from typing import List

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib

from tfgc import collectives
from tfgc.collectives.allgather import (num_payload_words, padded_payload_words,
                                        unpack_payload_words)
from tfgc.compressors import CompressContext, ErrorFeedback, get as get_compressor, serialize_config
from tfgc.compressors.powersgd import orthogonalize
from tfgc.distribute import fusion, gradients, moments, paths
from tfgc.distribute import state as state_lib
from tfgc.distribute.policy import CompressionPolicy
from tfgc.distribute.stats import CompressionStats, WireBytes

# The settings string every worker sends before its first compressed step.
_SETTINGS_WORDS = 256
# Collectives that move state or settings (not gradients) give up after this long,
# so a worker that saves or starts alone fails with a message instead of hanging.
_EXCHANGE_TIMEOUT_S = 600.0


def _nbytes(t) -> int:
    return int(t.shape.num_elements()) * t.dtype.size



def _payload_bytes(payload, gathered: bool) -> int:
    """Bytes a payload occupies on the wire (int32 words when gathered)."""
    if not gathered:
        return sum(_nbytes(p) for p in payload)
    return 4 * num_payload_words(payload)


def check_compression_args(compressor, policy, communication, bucket_bytes):
    """Validates the compression settings; returns ``(compressor, policy)`` built from them.

    Raises ``ValueError`` naming the offending argument.
    """
    compressor = get_compressor(compressor)
    policy = CompressionPolicy() if policy is None else policy
    if not isinstance(policy, CompressionPolicy):
        raise ValueError(f"`policy` must be a tfgc.CompressionPolicy, got {policy!r}")
    paths.check_communication(communication, compressor)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"`bucket_bytes` must be a positive integer, got {bucket_bytes!r}")
    return compressor, policy


class _TwoStageState:
    """The state template of the reduce-scatter: error feedback adds the owner's residual.

    ``server_residual`` holds this worker's chunk, flat, padded to the longest
    chunk (the same length on every worker, so the checkpoint rows line up).
    """

    def __init__(self, compressor, num_ranks: int):
        self._compressor = compressor
        self._num_ranks = num_ranks

    def init_state(self, shape, dtype):
        template = self._compressor.init_state(shape, dtype)
        if isinstance(self._compressor, ErrorFeedback):
            layout = self._compressor.chunk_layout(shape, self._num_ranks)
            width = max(int(c.num_elements()) for _, _, c in
                        collectives.chunk_plan(layout, shape, self._num_ranks).chunks)
            template = dict(template, server_residual=tf.zeros([width], dtype))
        return template


def _step_digits(step) -> tf.Tensor:
    """The low 32 bits of ``step`` as four 8-bit digits and their squares (float32).

    Summed over at most 256 workers these stay below 2**24, so a float32
    all-reduce adds them exactly, and n * sum(d^2) - sum(d)^2 is zero for every
    digit exactly when all workers hold the same step.
    """
    low = tf.cast(tf.bitwise.bitwise_and(step, 0xFFFFFFFF), tf.int64)
    digits = [tf.cast(tf.bitwise.bitwise_and(tf.bitwise.right_shift(low, 8 * i), 0xFF), tf.float32)
              for i in range(4)]
    return tf.stack([x for d in digits for x in (d, d * d)])


def _digits_agree(sums, num_workers):
    """From the summed control vector [flag, d0, d0^2, ...]: (any worker bad, steps agree)."""
    sums = tf.cast(sums, tf.float64)
    d, d2 = sums[1::2], sums[2::2]
    return sums[0] > 0.5, tf.reduce_all(tf.equal(num_workers * d2, d * d))


def _checked(any_bad, steps_agree, step, steps_seen):
    """``not any_bad``, after an assertion that every worker is at the same step."""
    agree = tf.debugging.Assert(steps_agree, [
        "tfgc: the workers' compression step counters differ: compressor state was "
        "reset or restored on some workers only. This worker's step and the "
        "counters seen:", step, steps_seen], summarize=64)
    with tf.control_dependencies([agree]):
        return tf.identity(tf.logical_not(any_bad))


def _local_bad(tensors):
    """int32 scalar: 1 if any of ``tensors`` holds an inf or NaN."""
    finite = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors]
    return 1 - tf.cast(tf.reduce_all(tf.stack(finite)), tf.int32)


def _control_words(local_bad, step, dtype):
    """The control vector this worker adds to an all-reduce: [bad flag, step digits]."""
    flag = tf.cast(local_bad, tf.float32)[None]
    return tf.cast(tf.concat([flag, _step_digits(step)], 0), dtype)


def _commit_or_skip(ok, step_var, compressed, tensors, reduced, decode_and_commit_one):
    """Every reduction's last step: the outputs for ``tensors``.

    If ``ok`` (None: unchecked), ``decode_and_commit_one(i)`` decodes compressed
    gradient i and writes its new state, and the step counter advances; otherwise
    the compressed gradients come out NaN and no state changes. Gradients sent
    dense come from ``reduced``.
    """
    def decode_and_commit():
        outs = [decode_and_commit_one(i) for i in compressed]
        with tf.control_dependencies(outs):
            step_var.assign_add(1)
        return outs

    if ok is None:
        decoded = decode_and_commit()
    else:
        def skip():
            return [tf.fill(tf.shape(tensors[i]), tf.constant(float("nan"), tensors[i].dtype))
                    for i in compressed]
        decoded = tf.cond(ok, decode_and_commit, skip)
        decoded = list(decoded) if isinstance(decoded, (list, tuple)) else [decoded]
    decoded = dict(zip(compressed, decoded))
    return [decoded[i] if i in decoded else reduced[i] for i in range(len(tensors))]


def _dense_momentum(compressor, state, variables, mask, reduced, ok, replica_id):
    """The compressor's momentum on the gradients sent dense, after their all-reduce.

    A compressor that applies momentum on the workers (DGC) takes it away from the
    optimizer, so the gradients it does not compress get it here: u <- m u + r, and
    u goes on (Nesterov: r + m u). The buffer keeps its value when any gradient of
    the step is non-finite, as the compressed ones' state does.
    """
    m = compressor.applied_momentum
    dense = [i for i, compressed in enumerate(mask)
             if not compressed and state.has_slot(variables[i])]
    if not dense:
        return reduced
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(reduced[i]))
                                     for i in dense]))
    if ok is not None:
        finite = tf.logical_and(finite, ok)
    out, updates = list(reduced), []
    for i in dense:
        buffer = state.slot(variables[i], replica_id)["momentum"]
        old = buffer.read_value()
        new = old * tf.cast(m, old.dtype) + reduced[i]
        out[i] = reduced[i] + tf.cast(m, old.dtype) * new if compressor.nesterov else new
        updates.append(buffer.assign(tf.where(finite, new, old)))
    with tf.control_dependencies(updates):
        return [tf.identity(r) for r in out]


def _corrected(compressor, t, slot):
    """Error feedback's momentum correction of ``t`` for the paths that read the
    residual themselves: ``(what to compress, new state entries to commit)``."""
    current = {"momentum": slot["momentum"].read_value()} if "momentum" in slot else {}
    return compressor.corrected(t, current)


def _weight(compressor, variable):
    """The variable's current value for a compressor that reads it; None otherwise."""
    if not compressor.needs_weights:
        return None
    if variable is None:
        raise ValueError(f"{compressor!r} reads the variables' values, and this reduction "
                         "does not name them: use tfgc.compress_gradients(variables)")
    return tf.identity(variable)


def _assign(slot, entries):
    for key, value in entries.items():
        slot[key].assign(value)


def _optimizer_momentum(optimizer):
    """(class name, the momentum it applies to gradients, whether it keeps moments)."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer  # LossScaleOptimizer
    name = type(inner).__name__
    value = getattr(inner, "momentum", 0.0)
    try:
        with tf.init_scope():
            value = float(tf.get_static_value(value) if tf.is_tensor(value) else value)
    except (TypeError, ValueError):
        value = 0.0
    return name, value, hasattr(inner, "beta_1")


def _check_momentum(owner, compressor):
    """Stops a compressor's momentum correction from meeting the optimizer's momentum."""
    name, value, moments = _optimizer_momentum(owner)
    m = compressor.applied_momentum
    fix = (f"compile with SGD(momentum=0.0) (the compressor's momentum replaces the "
           f"optimizer's), or pass momentum=0 to the compressor to keep {name}'s own")
    if value:
        raise ValueError(
            f"compressor {compressor.name!r} applies momentum {m} on the workers (momentum "
            f"correction) and the optimizer {name} applies momentum {value} again: {fix}")
    if moments:
        raise ValueError(
            f"compressor {compressor.name!r} applies momentum {m} on the workers (momentum "
            f"correction), and {name} keeps moment estimates of its own: {fix}")


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
      communication: "auto" (the fewest bytes: all-reduce for summable payloads,
        the reduce-scatter from 3 workers on for quantizers whose second stage
        needs no error feedback or that apply momentum correction, the low-rank
        path for PowerSGD, the shared index for importance-weighted pruning,
        all-gather otherwise; see ``paths.auto``), "allreduce" (summable
        compressors only), "allgather", "reduce_scatter" (quantizers whose sum can
        be compressed again), "shared_index" (sparsifiers that select indices),
        "sparse_allreduce" (sparsifiers with (values, indices) payloads) or
        "low_rank" (PowerSGD).
      bucket_bytes: upper bound on the per-worker size of one fused all-gather, and
        of one message of the reduce-scatter.
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
        # Our own copies of the constructor's arguments, instead of the parent's private
        # fields. Two are read from the parent once, here: the devices in its canonical
        # form, and the collective keys it made when none were given.
        self._num_replicas = group_size
        self._comm_options = options
        self._canonicalize = canonicalize_devices
        self._replica_devices = tuple(self._devices)  # pylint: disable=protected-access
        self._keys = self._collective_keys  # pylint: disable=protected-access
        self._stats = CompressionStats(self._replica_devices[0])
        self._generation = 0
        self._generation_var = None
        self._settings_checked = -1
        self._settings_lock = threading.Lock()
        self._cross_replica_ctx = None
        self._states = weakref.WeakSet()
        self._models = weakref.WeakSet()
        self._exchangers = {}
        self._auto_choice = None  # (generation, path) once auto has seen the gradients
        # Per replica, while a reduction is traced: kernel key -> its gradient's
        # per-sample second moment (variance-based compression).
        self._second_moments = {}

    # -- public --------------------------------------------------------------------

    @property
    def compressor(self):
        return self._compressor

    @compressor.setter
    def compressor(self, value):
        """Switches compressor from the next step on.

        Registered Keras models get a new train function (also in the middle of
        ``fit``); a custom ``tf.function`` traced with the old compressor fails at
        its next call with a message saying to retrace it. Each owner's state is
        migrated at the next trace: residuals carry over, the rest starts fresh.
        """
        compressor = get_compressor(value)
        paths.check_communication(self._communication, compressor)
        self._compressor = compressor
        self._generation += 1
        if self._generation_var is not None:
            self._generation_var.assign(self._generation)
        for model in list(self._models):
            if getattr(model, "train_function", None) is not None:
                model.make_train_function(force=True)

    @property
    def policy(self):
        return self._policy

    @property
    def stats(self) -> CompressionStats:
        return self._stats

    @property
    def local_devices(self):
        return tuple(self._replica_devices)

    @property
    def group_size(self) -> int:
        return self._num_replicas

    @property
    def worker_rank(self) -> int:
        return self._worker_rank

    def states(self):
        """The live ``CompressionState`` objects (one per optimizer that trained)."""
        return list(self._states)

    def register_model(self, model):
        self._models.add(model)

    def settings(self) -> str:
        """What every worker must agree on, as one line."""
        import tfgc
        return (f"tfgc {tfgc.__version__}, tensorflow {tf.__version__}, compressor "
                f"{serialize_config(self._compressor)}, policy {self._policy.get_config()}, "
                f"communication {self._communication}, bucket_bytes {self._bucket_bytes}")

    def _path(self) -> str:
        """The communication this compressor uses: ``communication``, or auto's choice."""
        if self._communication != "auto":
            return self._communication
        if self._auto_choice is not None and self._auto_choice[0] == self._generation:
            return self._auto_choice[1]
        return paths.choose_communication(self._compressor, self._num_replicas)[0]

    def _choose(self, tensors, mask):
        """Settles auto's choice from the compressed gradients' shapes (once per compressor)."""
        if self._communication != "auto" or (
                self._auto_choice is not None and self._auto_choice[0] == self._generation):
            return
        gradients_ = [(t.shape, t.dtype) for t, m in zip(tensors, mask)
                      if m and t.shape.num_elements() >= self._num_replicas]
        path, figures = paths.choose_communication(self._compressor, self._num_replicas,
                                                         gradients_)
        self._auto_choice = (self._generation, path)
        if figures:
            logging.info("tfgc: communication='auto' chose %s for %r on %d workers; bytes sent "
                         "per worker and step: %s", path, self._compressor, self._num_replicas,
                         ", ".join(f"{k} {v}" for k, v in sorted(figures.items())))
        else:
            logging.info("tfgc: communication='auto' chose %s for %r on %d workers", path,
                         self._compressor, self._num_replicas)

    def _use_allreduce(self) -> bool:
        return self._path() == "allreduce"

    def _path_name(self) -> str:
        return {"shared_index": "the shared-index all-reduce",
                "sparse_allreduce": "the sparse all-reduce",
                "reduce_scatter": "the reduce-scatter / all-gather",
                "low_rank": "two all-reduces of low-rank factors",
                "allreduce": "all-reduce"}.get(self._path(), "all-gather")

    # -- exchanges outside the training step ----------------------------------------

    def _exchange_options(self):
        return self._comm_options.merge(
            tf.distribute.experimental.CommunicationOptions(timeout_seconds=_EXCHANGE_TIMEOUT_S))

    def gather_rows(self, rows: List[tf.Tensor]) -> tf.Tensor:
        """All-gathers one int32 vector per local replica; returns ``[group_size, words]``.

        Runs eagerly (under ``init_scope``); every worker must call it at the same
        point with vectors of the same length.
        """
        with tf.init_scope():
            words = int(rows[0].shape[0])
            if self._num_replicas == 1:
                return tf.stack(rows)
            options = self._exchange_options()

            def gather_all():
                out = []
                for launcher, row in zip(self._launchers, rows):
                    out.append(collectives.all_gather(launcher, row, options))
                return out

            if len(self._launchers) == 1:
                gathered = gather_all()[0]
            else:
                # Several local replicas must join the collective at once.
                gathered = tf.function(gather_all, autograph=False)()[0]
            return tf.reshape(gathered, [self._num_replicas, words])

    def _exchange_settings(self):
        """Stops with a clear error if the workers' compression settings differ."""
        with self._settings_lock:
            if self._settings_checked == self._generation:
                return
            mine = self.settings()
            raw = mine.encode()
            if len(raw) > 4 * _SETTINGS_WORDS:
                digest = hashlib.sha1(raw).hexdigest().encode()
                raw = raw[:4 * _SETTINGS_WORDS - len(digest) - 4] + b" ..." + digest
            raw = raw.ljust(4 * _SETTINGS_WORDS, b"\0")
            with tf.init_scope():
                rows = []
                for device in self._replica_devices:
                    with tf.device(device):
                        rows.append(tf.constant(np.frombuffer(raw, dtype=np.int32)))
                table = self.gather_rows(rows).numpy()
            everyone = [bytes(table[i].tobytes()).rstrip(b"\0").decode(errors="replace")
                        for i in range(table.shape[0])]
            for rank, theirs in enumerate(everyone):
                if theirs != everyone[0]:
                    raise ValueError(
                        "tfgc: the workers' compression settings differ; every worker must run "
                        f"the same compressor, policy and versions.\n  replica 0: {everyone[0]}"
                        f"\n  replica {rank}: {theirs}")
            self._settings_checked = self._generation

    def _check_settings_from_replica(self):
        if self._settings_checked == self._generation:
            return
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is not None and len(self._replica_devices) > 1:
            # Replica threads take turns; the exchange runs once, in the merge.
            replica_ctx.merge_call(lambda _: self._exchange_settings())
        else:
            self._exchange_settings()

    def _generation_guard(self):
        """An op that fails if the compressor was switched after this graph was traced."""
        if tf.executing_eagerly():
            return None
        with tf.init_scope(), tf.device(self._replica_devices[0]):
            if self._generation_var is None:
                self._generation_var = tf.Variable(self._generation, dtype=tf.int64,
                                                   trainable=False, name="tfgc_generation")
        return tf.debugging.assert_equal(
            self._generation_var.read_value(), tf.constant(self._generation, tf.int64),
            message="tfgc: the compressor was switched after this tf.function was traced; "
                    "trace it again (a new tf.function) to use the new compressor")

    # -- CrossDeviceOps ------------------------------------------------------------

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        """As the parent, but a lone replica's values still go through ``_all_reduce``.

        The stock implementation returns the values of a single-worker,
        single-device strategy untouched. Reducing them anyway (over a collective
        group of one: exact for everything but gradients, which are compressed)
        lets a one-machine run show the accuracy and the byte figures that the
        compressor gives on a cluster.
        """
        if self._num_replicas == 1 and value_destination_pairs:
            if options is None:
                options = tf.distribute.experimental.CommunicationOptions()
            pairs = value_destination_pairs
            if not cross_device_ops_lib._validate_value_destination_pairs(pairs):  # pylint: disable=protected-access
                pairs = cross_device_ops_lib._normalize_value_destination_pairs(pairs)  # pylint: disable=protected-access
            return self.batch_reduce_implementation(reduce_op, pairs, options)
        return super().batch_reduce(reduce_op, value_destination_pairs, options)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        # Cross-replica reductions run one _all_reduce per local device, in pool
        # threads when eager: hand them this thread's gradient context explicitly.
        self._cross_replica_ctx = gradients.current()
        try:
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
        finally:
            self._cross_replica_ctx = None

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self._cross_replica_ctx = gradients.current()
        try:
            return super().reduce_implementation(reduce_op, per_replica_value, destinations,
                                                 options)
        finally:
            self._cross_replica_ctx = None

    def _all_reduce(self, reduce_op, value, replica_id, options):
        """Replica-context all-reduce; also reached by the cross-replica reductions."""
        flat = tf.nest.flatten(value)
        ctx = gradients.current() or self._cross_replica_ctx
        if ctx is None or not ctx.matches(flat, replica_id):
            # Not a gradient aggregation: the stock, exact path.
            return super()._all_reduce(reduce_op, value, replica_id, options)
        ctx.mark_used(replica_id)
        self._check_settings_from_replica()
        results = self._gradient_reduce(flat, ctx, replica_id, options)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            def mean(r):
                if isinstance(r, tf.IndexedSlices):
                    return tf.IndexedSlices(
                        r.values / tf.cast(self._num_replicas, r.values.dtype), r.indices,
                        r.dense_shape)
                return r / tf.cast(self._num_replicas, r.dtype)

            with tf.device(self._replica_devices[replica_id]):
                results = [mean(r) for r in results]
        return tf.nest.pack_sequence_as(value, results)

    def _gradient_reduce(self, flat, ctx, replica_id, options):
        launcher = self._launchers[replica_id]
        options = self._comm_options.merge(options)
        device = self._replica_devices[replica_id]
        compressor = self._compressor
        n = self._num_replicas
        rank = self._worker_rank + replica_id
        results = [None] * len(flat)
        slices_pos = [i for i, v in enumerate(flat) if isinstance(v, tf.IndexedSlices)]
        tensor_pos = [i for i in range(len(flat)) if i not in slices_pos]
        # Moment probes' gradients (tfgc.keras.MomentDense) travel with the gradients
        # but are not sent: they are handed to the compressor of their kernel, and
        # the optimizer gets zeros for them.
        probes = {i: moments.kernel_key_of(ctx.variables[i]) for i in tensor_pos}
        probes = {i: key for i, key in probes.items() if key is not None}
        self._second_moments[replica_id] = {
            key: tf.convert_to_tensor(flat[i]) for i, key in probes.items()}
        for i in probes:
            results[i] = tf.zeros_like(flat[i])
        tensor_pos = [i for i in tensor_pos if i not in probes]
        tensors = [tf.convert_to_tensor(flat[i]) for i in tensor_pos]
        variables = [ctx.variables[i] for i in tensor_pos]
        mask = [self._policy.should_compress(t, compressor) for t in tensors]
        if compressor.needs_second_moment:
            mask = self._with_moments(compressor, variables, mask, replica_id)
        wire = WireBytes(n)

        if compressor.applied_momentum:
            _check_momentum(ctx.owner, compressor)
        state = None
        if not any(mask):
            # Nothing worth compressing (biases only, float64): the stock path.
            reduced = super()._all_reduce(tf.distribute.ReduceOp.SUM, tensors, replica_id, options) \
                if tensors else []
            for t in tensors:
                wire.allreduce(_nbytes(t), dense=_nbytes(t))
            ok = None
        else:
            self._choose(tensors, mask)
            state = self._state_for(ctx.owner, compressor, variables, mask)
            reduce_fn = {"shared_index": self._shared_index_reduce,
                         "sparse_allreduce": self._sparse_reduce,
                         "reduce_scatter": self._reduce_scatter_reduce,
                         "low_rank": self._low_rank_reduce}.get(
                             self._path(), self._compressed_reduce)
            guard = self._generation_guard()
            with tf.device(device), \
                    tf.control_dependencies([guard] if guard is not None else []):
                step_var = state.step(replica_id)
                unfuse = None
                if compressor.fuses_gradients:
                    # One vector per dtype (gradient dropping's global threshold).
                    fused_t, fused_v, fused_m, unfuse = fusion.fuse(tensors, variables, mask)
                    args = (fused_t, fused_v, fused_m, fusion.FusedState(state), step_var,
                            launcher, rank, replica_id, options)
                else:
                    args = (tensors, variables, mask, state, step_var, launcher, rank,
                            replica_id, options)
                stages = compressor.stages()
                if stages:
                    reduced, ok = self._staged_reduce(stages, reduce_fn, args, wire,
                                                      compressor.stage_period)
                else:
                    reduced, ok = reduce_fn(compressor, *args, wire)
                if unfuse is not None:
                    reduced = unfuse(reduced)
        if compressor.applied_momentum and tensors:
            if state is None:
                state = self._state_for(ctx.owner, compressor, variables, mask)
            with tf.device(device):
                reduced = _dense_momentum(compressor, state, variables, mask, reduced, ok,
                                          replica_id)
        for i, r in zip(tensor_pos, reduced):
            results[i] = r

        if slices_pos:
            # Embedding gradients (IndexedSlices) keep the stock gather-based path.
            slices = [flat[i] for i in slices_pos]
            reduced_slices = super()._all_reduce(tf.distribute.ReduceOp.SUM, slices, replica_id,
                                                 options)
            for i, s, r in zip(slices_pos, slices, reduced_slices):
                results[i] = r
                dense = int(np.prod(ctx.variables[i].shape)) * s.values.dtype.size
                wire.indexed_slices(s, dense)

        if replica_id == 0:
            self._stats.record(wire, ok)
            if not tf.executing_eagerly() and wire.dynamic_payload:
                logging.log_first_n(
                    logging.INFO,
                    "tfgc: %d of %d gradients compressed with %r over %s, in %d stages by step; "
                    "per worker and step: %d bytes of gradients", 4, sum(mask), len(flat),
                    compressor, self._path_name(), len(compressor.stages()), wire.dense)
            elif not tf.executing_eagerly():
                logging.log_first_n(
                    logging.INFO,
                    "tfgc: %d of %d gradients compressed with %r over %s; per worker and step: "
                    "%d bytes of gradients, %d bytes of payload, %d sent (a dense ring all-reduce "
                    "sends %d)", 4, sum(mask), len(flat), compressor,
                    self._path_name(), wire.dense,
                    wire.payload, wire.static_sent, wire.dense_sent)
        return results

    def _with_moments(self, compressor, variables, mask, replica_id):
        """The mask without the gradients that have no second moment (kernels of
        layers other than MomentDense), which go dense; stops when none has one."""
        have = self._second_moments.get(replica_id, {})
        out = [m and v is not None and state_lib.var_key(v) in have
               for m, v in zip(mask, variables)]
        if any(mask) and not any(out):
            raise ValueError(
                f"{compressor!r} needs the per-sample second moments of the gradients: "
                "build the model's dense layers with tfgc.keras.MomentDense")
        if out != mask:
            logging.log_first_n(logging.INFO, "tfgc: %d gradients without a second moment "
                                "(not from a MomentDense layer) go dense", 1,
                                sum(mask) - sum(out))
        return out

    def _second_moment(self, compressor, variable, replica_id):
        if not compressor.needs_second_moment:
            return None
        return self._second_moments[replica_id][state_lib.var_key(variable)]

    def _state_for(self, owner, compressor, variables, mask):
        """The owner's compression state, registered for ``variables`` on this path."""
        layout = _TwoStageState(compressor, self._num_replicas) \
            if self._path() == "reduce_scatter" else compressor
        state = state_lib.state_for(owner, self, layout, repr(serialize_config(compressor)),
                                    variables, mask)
        self._states.add(state)
        return state

    def _staged_reduce(self, stages, reduce_fn, args, wire, period=0):
        """Runs the stage of ``stages`` that the step counter is in (DGC's warm-up).

        Each stage is its own branch of a ``tf.switch_case`` with its own static
        payload sizes and collectives; the counter is the same on every worker, so
        all take the same branch. The branch reports its byte figures.
        """
        step_var = args[4]
        step = step_var.read_value()
        if period:
            # Stages that repeat (GradiVeQ's windows): the position in the cycle.
            step = tf.math.floormod(step, tf.cast(period, step.dtype))
        index = tf.add_n([tf.cast(step >= first, tf.int32) for first, _ in stages[1:]])
        dense = []

        def branch(stage_compressor):
            def run():
                w = WireBytes(self._num_replicas)
                outs, ok = reduce_fn(stage_compressor, *args, w)
                dense.append(w.dense)
                sent = tf.constant(w.static_sent, tf.int64)
                if w.dynamic_sent:
                    sent += tf.add_n(w.dynamic_sent)
                ok = tf.constant(True) if ok is None else ok
                return list(outs), ok, tf.constant(w.payload, tf.int64), sent
            return run

        outs, ok, payload, sent = tf.switch_case(index, [branch(c) for _, c in stages])
        wire.staged(dense[-1], payload, sent)
        return list(outs), ok

    def _compress_each(self, compressor, tensors, variables, compressed, state, step, rank,
                       replica_id):
        """Compresses each gradient in ``compressed`` with its state, writing nothing.

        Returns dicts by position: payloads, contexts, state slots, new states.
        """
        payloads, contexts, slots, new_states = {}, {}, {}, {}
        for index, i in enumerate(compressed):
            cctx = CompressContext(rank=rank, num_workers=self._num_replicas, index=index,
                                   step=step, weight=_weight(compressor, variables[i]),
                                   second_moment=self._second_moment(compressor, variables[i],
                                                                     replica_id))
            slots[i] = state.slot(variables[i], replica_id)
            current = tf.nest.map_structure(lambda v: v.read_value(), slots[i])
            payload, new_states[i] = compressor.compress(tensors[i], current, cctx)
            payloads[i], contexts[i] = tuple(payload), cctx
        return payloads, contexts, slots, new_states

    def _compressed_reduce(self, compressor, tensors, variables, mask, state, step_var, launcher,
                           rank, replica_id, options, wire):
        n = self._num_replicas
        use_allreduce = self._use_allreduce()
        step = step_var.read_value()

        # 1. Compress. State is read now and written only once every worker's
        #    gradients are known to be finite.
        payloads, contexts, slots, new_states = self._compress_each(
            compressor, tensors, variables, [i for i, m in enumerate(mask) if m], state, step,
            rank, replica_id)
        has_state = any(tf.nest.flatten(s) for s in slots.values())
        # Stateless compressors that carry every inf/NaN through need no check.
        checked = has_state or not compressor.passes_non_finite
        local_bad = _local_bad([tensors[i] for i in payloads]) if checked else None

        # 2. Communicate: one fused all-reduce (per dtype) for dense tensors and
        #    summable payloads, fused all-gathers for the other payloads; the
        #    control words ride along.
        to_reduce = []
        for i, t in enumerate(tensors):
            if i not in payloads:
                to_reduce.append((i, t))
                wire.allreduce(_nbytes(t), dense=_nbytes(t))
            elif use_allreduce:
                if len(payloads[i]) != 1:
                    raise ValueError(f"{compressor!r} is summable, so its payload must be "
                                     f"one tensor, got {len(payloads[i])}")
                to_reduce.append((i, payloads[i][0]))
                wire.allreduce(_payload_bytes(payloads[i], False), dense=_nbytes(t))
        control = None
        if checked and use_allreduce:
            control = _control_words(local_bad, step, tf.float32)
            to_reduce.append((-1, control))
            wire.allreduce(_nbytes(control))
        # Reversed, as the stock implementation packs, so identity matches it bit for bit.
        reduced = collectives.fused_all_reduce(launcher, [t for _, t in to_reduce][::-1],
                                               options)[::-1]
        reduced = {i: r for (i, _), r in zip(to_reduce, reduced)}
        gathered, gathered_control = {}, None
        if not use_allreduce:
            order = sorted(payloads)
            extra = None
            if checked:
                extra = tf.stack([local_bad, tf.cast(tf.bitwise.bitwise_and(step, 0x7FFFFFFF),
                                                     tf.int32)])
            exchanged, gathered_control = collectives.gather_payloads(
                launcher, [payloads[i] for i in order], n, options, self._bucket_bytes,
                control=extra)
            gathered = dict(zip(order, exchanged))
            for i in order:
                wire.gather(_payload_bytes(payloads[i], True), dense=_nbytes(tensors[i]))
            if checked:
                wire.gather(8)

        # 3. Did every worker have finite gradients and the same step?
        ok = None
        if checked:
            if use_allreduce:
                any_bad, steps_agree = _digits_agree(reduced[-1], n)
                steps_seen = step
            else:
                any_bad = tf.reduce_any(gathered_control[:, 0] != 0)
                steps_seen = gathered_control[:, 1]
                steps_agree = tf.reduce_all(tf.equal(steps_seen, steps_seen[0]))
            ok = _checked(any_bad, steps_agree, step, steps_seen)

        # 4. Decode, combine and commit the new state, or keep the old one.
        def decode_and_commit_one(i):
            t = tensors[i]
            new_state = new_states[i]
            if use_allreduce:
                out, new_state = compressor.finish((reduced[i],), t.shape, t.dtype, contexts[i],
                                                   new_state)
            else:
                out = compressor.aggregate(gathered[i], t.shape, t.dtype, contexts[i])
            tf.nest.map_structure(lambda v, s: v.assign(s), slots[i], new_state)
            return out

        outputs = _commit_or_skip(ok, step_var, sorted(payloads), tensors, reduced,
                                  decode_and_commit_one)
        return outputs, ok

    def _shared_index_reduce(self, compressor, tensors, variables, mask, state, step_var, launcher,
                             rank, replica_id, options, wire):
        """Importance-weighted pruning's shared index set (Cheng & Xu 2019), with top-k.

        Each step a root, chosen in rotation (step mod N, the same on every worker),
        selects the index set of every compressed gradient from its own
        v = g + residual; the sets reach every worker through an int32 all-reduce
        (``collectives.share_root_indices``), the control words riding along.
        Every worker then gathers its own v at those indices and the values go
        through the plain fused all-reduce with the dense tensors. Under error
        feedback the new residual is v with the sent entries zeroed.
        """
        error_feedback = isinstance(compressor, ErrorFeedback)
        n = self._num_replicas
        step = step_var.read_value()
        is_root = tf.equal(tf.math.floormod(step, n), rank)
        compressed = [i for i, m in enumerate(mask) if m]

        # 1. The root selects; everyone learns its index sets.
        flat_v, slots, selections, velocities = {}, {}, [], {}
        for index, i in enumerate(compressed):
            t = tensors[i]
            slot = state.slot(variables[i], replica_id)
            v = tf.reshape(t, [-1])
            if error_feedback:
                corrected, velocities[i] = _corrected(compressor, t, slot)
                v = tf.reshape(corrected + slot["residual"].read_value(), [-1])
            cctx = CompressContext(rank=rank, num_workers=n, index=index, step=step,
                                   weight=_weight(compressor, variables[i]))
            k = compressor.num_selected(t.shape)
            # Only the root pays for the selection.
            chosen = tf.cond(is_root,
                             lambda v=v, t=t, c=cctx: compressor.select_indices(
                                 tf.reshape(v, t.shape), c),
                             lambda k=k: tf.zeros([k], tf.int32))
            flat_v[i], slots[i] = v, slot
            selections.append(chosen)
        control = _control_words(_local_bad([tensors[i] for i in compressed]), step,
                                 tf.int32)
        shared, control_sum = collectives.share_root_indices(launcher, selections, is_root,
                                                             options, control)
        shared = dict(zip(compressed, shared))
        for i in compressed:
            wire.allreduce(4 * int(shared[i].shape[0]), dense=_nbytes(tensors[i]))
        wire.allreduce(_nbytes(control))
        any_bad, steps_agree = _digits_agree(control_sum, n)
        ok = _checked(any_bad, steps_agree, step, step)

        # 2. Values at the shared indices, summed with the dense tensors.
        to_reduce = []
        for i, t in enumerate(tensors):
            if i in shared:
                # tf.gather checks every index: a corrupt set fails, never reads out of bounds.
                values = tf.gather(flat_v[i], shared[i])
                wire.allreduce(_nbytes(values))
            else:
                values = t
                wire.allreduce(_nbytes(t), dense=_nbytes(t))
            to_reduce.append(values)
        reduced = collectives.fused_all_reduce(launcher, to_reduce[::-1], options)[::-1]

        # 3. Scatter the sums back; commit the residuals, or keep them.
        def decode_and_commit_one(i):
            t = tensors[i]
            idx = shared[i][:, None]
            if error_feedback:
                kept = tf.tensor_scatter_nd_update(flat_v[i], idx, tf.zeros_like(reduced[i]))
                slots[i]["residual"].assign(tf.reshape(kept, t.shape))
                _assign(slots[i], velocities[i])
            return tf.reshape(tf.scatter_nd(idx, reduced[i], [t.shape.num_elements()]),
                              t.shape)

        outputs = _commit_or_skip(ok, step_var, compressed, tensors, reduced,
                                  decode_and_commit_one)
        return outputs, ok

    def _low_rank_reduce(self, compressor, tensors, variables, mask, state, step_var, launcher,
                         rank, replica_id, options, wire):
        """PowerSGD's shared power iteration: two fused all-reduces per step.

        Round 1 sums P_i = M_i Q (M_i = g_i + e_i, Q the shared query) with the
        dense gradients and the control words; every worker orthogonalizes the same
        sum into P^. Round 2 sums Q_i = M_i^T P^. The output is P^ Q^T, the residual
        M_i - P^ Q^T / N and the next query Q / N, committed only when every worker's
        gradients were finite (see ``tfgc.compressors.powersgd``).
        """
        n = self._num_replicas
        step = step_var.read_value()
        compressed = [i for i, m in enumerate(mask) if m]
        slots, matrices, factors = {}, {}, {}
        for index, i in enumerate(compressed):
            t = tensors[i]
            slots[i] = state.slot(variables[i], replica_id)
            cctx = CompressContext(rank=rank, num_workers=n, index=index, step=step)
            matrices[i] = compressor.matrix(t, slots[i]["residual"].read_value())
            query = compressor.query(slots[i]["query"].read_value(), cctx)
            factors[i] = tf.matmul(matrices[i], query)
            wire.allreduce(_nbytes(factors[i]), dense=_nbytes(t))
        control = _control_words(_local_bad([tensors[i] for i in compressed]), step, tf.float32)
        wire.allreduce(_nbytes(control))

        # Round 1: the P_i, the dense gradients and the control words.
        first = [factors[i] for i in compressed] + [control]
        dense_pos = [i for i in range(len(tensors)) if i not in slots]
        for i in dense_pos:
            first.append(tensors[i])
            wire.allreduce(_nbytes(tensors[i]), dense=_nbytes(tensors[i]))
        summed = collectives.fused_all_reduce(launcher, first[::-1], options)[::-1]
        reduced = dict(zip(dense_pos, summed[len(compressed) + 1:]))
        any_bad, steps_agree = _digits_agree(summed[len(compressed)], n)
        ok = _checked(any_bad, steps_agree, step, step)

        # Round 2: Q_i = M_i^T P^ for the same P^ everywhere.
        bases = {i: orthogonalize(p) for i, p in zip(compressed, summed)}
        second = []
        for i in compressed:
            second.append(tf.matmul(matrices[i], bases[i], transpose_a=True))
            wire.allreduce(_nbytes(second[-1]))
        queries = dict(zip(compressed, collectives.fused_all_reduce(
            launcher, second[::-1], options)[::-1]))

        def decode_and_commit_one(i):
            t = tensors[i]
            out = compressor.decompress((bases[i], queries[i]), t.shape, t.dtype, None)
            size = tf.cast(n, out.dtype)
            slots[i]["residual"].assign(tf.reshape(matrices[i], t.shape) - out / size)
            slots[i]["query"].assign(queries[i] / size)
            return out

        outputs = _commit_or_skip(ok, step_var, compressed, tensors, reduced,
                                  decode_and_commit_one)
        return outputs, ok

    def _exchanger(self, replica_id):
        if replica_id not in self._exchangers:
            self._exchangers[replica_id] = collectives.PairExchanger(
                self._worker_rank + replica_id, self._num_replicas,
                self._replica_devices[replica_id], self._comm_options)
        return self._exchangers[replica_id]

    def _sparse_reduce(self, compressor, tensors, variables, mask, state, step_var, launcher,
                       rank, replica_id, options, wire):
        """Top-k payloads summed by the sparse all-reduce with a dense switch.

        Every compressed gradient's (values, indices) go into one index space (each
        tensor at its own offset), merged stage by stage over pairwise exchanges
        (``collectives.sparse_all_reduce``); the control words take one small int32
        all-reduce of the whole group.
        """
        n = self._num_replicas
        step = step_var.read_value()
        compressed = [i for i, m in enumerate(mask) if m]
        payloads, _, slots, new_states = self._compress_each(
            compressor, tensors, variables, compressed, state, step, rank, replica_id)
        all_idx, all_val, offsets, length = [], [], {}, 0
        for i in compressed:
            values, indices = payloads[i]
            offsets[i] = length
            all_idx.append(indices + length)
            all_val.append(tf.cast(values, tf.float32))
            wire.exchanged(_payload_bytes(payloads[i], False), _nbytes(tensors[i]), 0)
            length += tensors[i].shape.num_elements()
        control = _control_words(_local_bad([tensors[i] for i in compressed]), step,
                                 tf.int32)
        control_sum = launcher.all_reduce(control, options=options)
        wire.allreduce(_nbytes(control))
        total, sent = collectives.sparse_all_reduce(
            self._exchanger(replica_id), n, tf.concat(all_idx, 0), tf.concat(all_val, 0),
            length)
        wire.dynamic_sent.append(sent)
        any_bad, steps_agree = _digits_agree(control_sum, n)
        ok = _checked(any_bad, steps_agree, step, step)

        reduced = self._reduce_dense(tensors, [i for i in range(len(tensors)) if i not in slots],
                                     launcher, options, wire)

        def decode_and_commit_one(i):
            t = tensors[i]
            part = total[offsets[i]:offsets[i] + t.shape.num_elements()]
            tf.nest.map_structure(lambda v, s: v.assign(s), slots[i], new_states[i])
            return tf.reshape(tf.cast(part, t.dtype), t.shape)

        outputs = _commit_or_skip(ok, step_var, compressed, tensors, reduced,
                                  decode_and_commit_one)
        return outputs, ok

    def _reduce_scatter_reduce(self, compressor, tensors, variables, mask, state, step_var, launcher,
                               rank, replica_id, options, wire):
        """Quantized reduce-scatter then all-gather, error feedback at both stages.

        Each compressed gradient is cut into one chunk per worker
        (``collectives.chunk_plan``). Stage 1 compresses every chunk (under error
        feedback, of v = g + residual, keeping v - decode as the new residual) and
        sends it to the chunk's owner; the owner combines the N payloads of its
        chunk with the compressor's ``aggregate`` (signSGD: the majority vote),
        adds its second residual and compresses the sum again (``recompress``).
        TernGrad first agrees on a shared scaler, and its owners send the exact
        sums of the ternary codes (``sum_codes``).
        Stage 2 all-gathers the owners' payloads, the control words riding along;
        every worker decodes the same payloads, so all end with the same bits.
        Messages hold up to ``bucket_bytes`` of chunks, last layers first.
        Gradients too small to cut into N chunks, and uncompressed ones, go
        through the fused dense all-reduce.
        """
        error_feedback = isinstance(compressor, ErrorFeedback)
        base = compressor.inner if error_feedback else compressor
        shared_scale = hasattr(base, "sum_codes") and not error_feedback
        n = self._num_replicas
        step = step_var.read_value()
        dense_pos = [i for i, t in enumerate(tensors)
                     if not mask[i] or t.shape.num_elements() < n]
        compressed = [i for i in range(len(tensors)) if i not in dense_pos]
        if not compressed:
            reduced = self._reduce_dense(tensors, dense_pos, launcher, options, wire)
            return [reduced[i] for i in dense_pos], None

        # Each gradient's place among the compressed ones seeds its contexts.
        position = {i: index for index, i in enumerate(compressed)}

        # 1. Cut, and compress every chunk for its owner. State is only read here.
        plans, chunks, slots, new_residuals, new_second = {}, {}, {}, {}, {}
        flats, velocities = {}, {}
        for i in compressed:
            t = tensors[i]
            plans[i] = collectives.chunk_plan(compressor.chunk_layout(t.shape, n), t.shape, n)
            slots[i] = state.slot(variables[i], replica_id)
            if error_feedback:
                t, velocities[i] = _corrected(compressor, t, slots[i])
            flats[i] = base.clipped(t) if shared_scale else tf.reshape(t, [-1])
        scales = {}
        if shared_scale:
            # TernGrad's shared scaler: the largest of the workers' (a tiny all-gather).
            local = tf.stack([tf.reduce_max(tf.abs(flats[i])) for i in compressed])
            everyone = tf.reshape(collectives.all_gather(launcher, local, options),
                                  [n, len(compressed)])
            wire.gather(_nbytes(local))
            shared = tf.reduce_max(everyone, axis=0)
            scales = {i: shared[j] for j, i in enumerate(compressed)}
        for index, i in enumerate(compressed):
            chunks[i], parts = [], []
            plan = plans[i]
            residual = slots[i]["residual"].read_value() if error_feedback else None
            for c in range(n):
                cctx = CompressContext(rank=rank, num_workers=n, index=index * (n + 1) + c,
                                       step=step)
                x = plan.take(flats[i], c)
                if error_feedback:
                    payload, _, r = base.compress_with_feedback(x, plan.take(residual, c), {},
                                                                cctx)
                    parts.append(r)
                elif shared_scale:
                    payload = base.compress_scaled(x, scales[i], cctx)
                else:
                    payload = base.compress(x, {}, cctx)[0]
                chunks[i].append(tuple(payload))
            if error_feedback:
                new_residuals[i] = plan.join(parts, tensors[i].shape)

        # 2. Buckets of at most bucket_bytes per message, the last layers' gradients
        #    (the first that back-propagation produces) first: a bucket's exchanges
        #    need only its own gradients, so they can run while earlier layers'
        #    gradients are still being computed and compressed.
        widths = {i: max(num_payload_words(p) for p in chunks[i]) for i in compressed}
        if shared_scale:
            # TernGrad's owners send exact sums of codes, in wider fields.
            second_like = {i: [(tf.TensorSpec([1], tf.float32), tf.TensorSpec(
                [base.count_payload_words(shape, n) - 1], tf.int32))
                for _, _, shape in plans[i].chunks]
                for i in compressed}
        else:
            second_like = chunks
        widths2 = {i: max(num_payload_words(p) for p in second_like[i]) for i in compressed}
        buckets, current = [], []
        for i in reversed(compressed):
            if current and 4 * (sum(widths[j] for j in current) + widths[i]) > self._bucket_bytes:
                buckets.append(current)
                current = []
            current.append(i)
        buckets.append(current)
        control = tf.stack([_local_bad([tensors[i] for i in compressed]),
                            tf.cast(tf.bitwise.bitwise_and(step, 0x7FFFFFFF), tf.int32)])
        gathered, gathered_control = {}, None
        exchanger = self._exchanger(replica_id)
        for b, bucket in enumerate(buckets):
            last = b == len(buckets) - 1
            # Stage 1: each chunk to its owner, the bucket's chunks in one message.
            outgoing = {p: tf.concat([padded_payload_words(chunks[i][p], widths[i])
                                      for i in bucket], 0)
                        for p in range(n) if p != rank}
            received = collectives.scatter_to_owners(exchanger, n, outgoing)
            message = sum(widths[i] for i in bucket)
            for i in bucket:
                sent = sum(num_payload_words(chunks[i][p]) for p in range(n) if p != rank)
                wire.pairwise(4 * sent, _nbytes(tensors[i]), 0)
            # A rank tag per exchange; padding to the longest chunk counts as sent.
            wire.pairwise(0, 0, (n - 1) * 4 * (message + 1))

            # The owner combines its chunk and compresses the result again.
            second = {}
            offset = 0
            for i in bucket:
                index = position[i]
                shape = plans[i].chunks[rank][2]
                mine = chunks[i][rank]
                payloads = [mine if w == rank else
                            unpack_payload_words(received[w][offset:offset + widths[i]], mine)
                            for w in range(n)]
                offset += widths[i]
                cctx = CompressContext(rank=rank, num_workers=n, index=index * (n + 1) + n,
                                       step=step)
                dtype = tensors[i].dtype
                if shared_scale:
                    second[i] = tuple(base.sum_codes(payloads, shape))
                    continue
                total = base.aggregate(payloads, shape, dtype, cctx)
                if error_feedback:
                    server = slots[i]["server_residual"].read_value()
                    size = shape.num_elements()
                    payload, _, r = base.compress_with_feedback(
                        total, tf.reshape(server[:size], shape), {}, cctx)
                    new_second[i] = tf.pad(tf.reshape(r, [-1]),
                                           [[0, int(server.shape[0]) - size]])
                else:
                    payload = base.recompress(total, cctx)
                second[i] = tuple(payload)

            # Stage 2: every owner's result to everyone; the control words ride on
            # the last bucket.
            words = tf.concat([padded_payload_words(second[i], widths2[i]) for i in bucket], 0)
            rows, rows_control = collectives.gather_from_owners(
                launcher, words, n, options, control if last else None)
            offset = 0
            for i in bucket:
                gathered[i] = rows[:, offset:offset + widths2[i]]
                offset += widths2[i]
                wire.gather(4 * num_payload_words(second[i]))
            padding = sum(widths2[i] - num_payload_words(second[i]) for i in bucket)
            extra = _nbytes(control) if last else 0
            wire.pairwise(extra, 0, (n - 1) * (4 * padding + extra))
            if last:
                gathered_control = rows_control

        reduced = self._reduce_dense(tensors, dense_pos, launcher, options, wire)

        steps_seen = gathered_control[:, 1]
        ok = _checked(tf.reduce_any(gathered_control[:, 0] != 0),
                      tf.reduce_all(tf.equal(steps_seen, steps_seen[0])), step, steps_seen)

        # 3. Decode every owner's chunk; commit both residuals, or keep them.
        def decode_and_commit_one(i):
            t = tensors[i]
            parts = []
            index = position[i]
            for w, (_, _, shape) in enumerate(plans[i].chunks):
                payload = unpack_payload_words(gathered[i][w], second_like[i][w])
                if shared_scale:
                    part = base.decode_counts(payload, shape, t.dtype, n)
                else:
                    cctx = CompressContext(rank=w, num_workers=n, index=index * (n + 1) + n,
                                           step=step)
                    part = base.decompress(payload, shape, t.dtype, cctx)
                parts.append(part)
            if error_feedback:
                slots[i]["residual"].assign(new_residuals[i])
                slots[i]["server_residual"].assign(new_second[i])
                _assign(slots[i], velocities[i])
            return plans[i].join(parts, t.shape)

        outputs = _commit_or_skip(ok, step_var, compressed, tensors, reduced,
                                  decode_and_commit_one)
        return outputs, ok

    @staticmethod
    def _reduce_dense(tensors, positions, launcher, options, wire):
        """The gradients at ``positions``, summed exactly by one fused all-reduce, by position."""
        dense = [tensors[i] for i in positions]
        for t in dense:
            wire.allreduce(_nbytes(t), dense=_nbytes(t))
        reduced = collectives.fused_all_reduce(launcher, dense[::-1], options)[::-1] \
            if dense else []
        return dict(zip(positions, reduced))

    # -- copying -------------------------------------------------------------------

    def __deepcopy__(self, memo):
        # distribute_coordinator deep-copies strategies; keep the class and settings.
        return CompressedAllReduce(
            self._replica_devices, self._num_replicas, self._comm_options,
            copy.deepcopy(self._keys, memo), self._canonicalize,
            compressor=self._compressor, policy=self._policy,
            communication=self._communication, bucket_bytes=self._bucket_bytes,
            worker_rank=self._worker_rank)
