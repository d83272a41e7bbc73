"""``CompressedAllReduce``: TensorFlow's collective all-reduce, with compression.

Only gradient aggregations are compressed: a reduction is one when it runs inside a
``tfgc.compress_gradients`` context whose variables match its values (Keras
optimizers open it by themselves, see ``keras_hooks``). Everything else (metrics,
batch-norm statistics, a user's own ``all_reduce``, ``strategy.reduce``) takes the
stock exact path.

A gradient aggregation, step by step:

  1. the policy splits the gradients into dense ones (small, 1-D, integer,
     float64) and compressed ones; embedding gradients (IndexedSlices) join them
     summed into a dense gradient, or travel as compressed rows after the others, or
     take the stock gather, as ``embeddings.mode`` says;
  2. each compressed gradient is compressed with its variable's state, read from
     the owner's ``CompressionState``; nothing is written yet;
  3. the gradients are cut into buckets of about ``overlap_bytes``, last layers
     first (``buckets``), and each bucket takes the path on its own as soon as its
     gradients exist, while back-propagation goes on: dense tensors and summable
     payloads through one fused all-reduce per dtype, other payloads packed into
     int32 words and all-gathered (or the path's own collectives). A few *control*
     words ride along: whether this worker's gradients in the bucket were all
     finite, and its step counter. The payloads are decoded and combined in rank
     order (bit-identical on every worker) as soon as they are in;
  4. if every worker's gradients were finite in every bucket, every bucket's new
     state is written; otherwise the compressed gradients come out as NaN on every
     worker (so a ``LossScaleOptimizer`` skips the step) and the state stays as it
     was;
  5. MEAN divides by the group size, as the stock implementation does.

All collectives go through the launchers of the parent class, so they share its
instance keys and ordering token. Before the first compressed reduction of each
compressor, the workers exchange their settings and stop with a message naming
both if they differ.
"""

import copy
import threading
import weakref
from typing import List

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.ops import resource_variable_ops

from tfgc import collectives
from tfgc.compressors import get as get_compressor, serialize_config
from tfgc.compressors.base import check_int
from tfgc.distribute import buckets, embeddings, fusion, gradients, moments, momentum, paths
from tfgc.distribute import autoplan, planner
from tfgc.distribute import settings as settings_lib
from tfgc.distribute import state as state_lib
from tfgc.distribute.policy import CompressionPolicy
from tfgc.distribute.stats import CompressionStats, WireBytes

# Collectives that move state or settings (not gradients) give up after this long,
# so a worker that saves or starts alone fails with a message instead of hanging.
_EXCHANGE_TIMEOUT_S = 600.0


# The default of ``overlap_bytes``, gradient bytes per bucket: a model of up to 25 MiB of
# gradients stays one bucket (on the wide MLP, 23 MB, buckets of 4 MiB cost 2-14 % a step
# with 4 workers on 2 cores and gained nothing), a larger one is cut in a few (ResNet-50,
# 94 MB: 4); PyTorch's DistributedDataParallel buckets 25 MiB by default too
# (bucket_cap_mb). Measured: docs/results.md, "Overlap".
DEFAULT_OVERLAP_BYTES = 25 << 20
# The default of ``bucket_bytes``, the largest per-worker message of a fused all-gather
# or of the reduce-scatter.
DEFAULT_BUCKET_BYTES = 32 << 20


def check_compression_args(compressor, policy, communication, bucket_bytes,
                           overlap_bytes=DEFAULT_OVERLAP_BYTES):
    """Validates the compression settings; returns ``(compressor, policy)`` built from them.

    Raises ``ValueError`` naming the offending argument.
    """
    compressor = get_compressor(compressor)
    policy = CompressionPolicy() if policy is None else policy
    if not isinstance(policy, CompressionPolicy):
        raise ValueError(f"`policy` must be a tfgc.CompressionPolicy, got {policy!r}")
    paths.check_communication(communication, compressor)
    check_int("bucket_bytes", bucket_bytes, 1)
    check_int("overlap_bytes", overlap_bytes, 0)
    return compressor, policy


def _take_carried(state, tensors, variables, replica_id):
    """The residuals that a switch of compressor or plan took off error feedback
    (``CompressionState.carried``), added to this step's gradients (compressed or not)
    while they await sending (``carried_pending``), each on its own so that no
    gradient waits for another's.

    Returns ``(tensors, the variables that hold them)``; ``_let_go`` zeroes those once
    the step commits, so what error feedback held back is sent once."""
    carried = {i: state.carried(v, replica_id) for i, v in enumerate(variables)
               if v is not None}
    carried = {i: c for i, c in carried.items() if c is not None}
    if not carried:
        return tensors, []
    pending = state.carried_pending(replica_id).read_value()
    out = list(tensors)
    for i, c in carried.items():
        t = tensors[i]
        out[i] = tf.cond(pending, lambda t=t, c=c: t + tf.cast(c, t.dtype),
                         lambda t=t: tf.identity(t))
    return out, list(carried.values())


def _with_carried_rows(slices, residual, pending):
    """``slices`` (a table's gradient as rows) and, while ``pending``, the rows of
    ``residual`` (kept apart from error feedback, ``CompressionState.carried``) that hold
    anything: the optimizer adds rows that repeat, so each goes once more with what it
    held back. Not pending, the residual is not read."""
    def held():
        return tf.where(tf.reduce_any(tf.not_equal(residual, 0),
                                      axis=list(range(1, residual.shape.rank))))[:, 0]

    rows = tf.cond(pending, held, lambda: tf.zeros([0], tf.int64))
    values = tf.cast(tf.gather(residual, rows), slices.values.dtype)
    return tf.IndexedSlices(tf.concat([slices.values, values], 0),
                            tf.concat([slices.indices, tf.cast(rows, slices.indices.dtype)], 0),
                            slices.dense_shape)


def _committed(ok, reduced):
    """Whether the step committed: ``ok``, or where no path checked (None), every
    reduced floating value finite (sums over the workers: the same answer on every
    worker; rows count by their values)."""
    if ok is not None:
        return ok
    values = [r.values if isinstance(r, tf.IndexedSlices) else r for r in reduced]
    return tf.math.is_finite(tf.add_n(
        [tf.reduce_sum(tf.cast(v, tf.float32)) for v in values if v.dtype.is_floating]))


def _let_go_rows(carried, reduced, ok):
    """``_let_go`` for the residuals that ``_with_carried_rows`` sent with tables' rows
    (``carried``: position, residual, pending flag, its value this step): each that was
    pending is zeroed, and its flag cleared, if the step committed (``ok``; None: every
    reduced value finite)."""
    committed = _committed(ok, reduced)
    for _, residual, flag, pending in carried:
        def zero(residual=residual, flag=flag):
            with tf.control_dependencies([residual.assign(tf.zeros_like(residual)),
                                          flag.assign(False)]):
                return tf.constant(True)

        tf.cond(tf.logical_and(committed, pending), zero, lambda: tf.constant(False))


def _let_go(state, carried, reduced, ok, replica_id):
    """Zeroes ``carried`` (``_take_carried``) after ``reduced`` exists, and clears the
    flag that they await sending, if the step committed: ``ok``, or where no path
    checked (None), every reduced gradient finite (sums over the workers: the same
    answer on every worker). A step skipped for a non-finite gradient (a loss scale's
    overflow) keeps them for the next; a step after they went costs a flag's read."""
    if not carried:
        return
    flag = state.carried_pending(replica_id)

    def settle():
        committed = _committed(ok, reduced)

        def zero():
            writes = [v.assign(tf.zeros_like(v)) for v in carried]
            with tf.control_dependencies(writes + [flag.assign(False)]):
                return tf.constant(True)

        return tf.cond(committed, zero, lambda: tf.constant(False))

    with tf.control_dependencies(reduced):
        tf.cond(flag.read_value(), settle, lambda: tf.constant(False))


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
      overlap_bytes: gradient bytes per bucket: a step's gradients are reduced in
        buckets of about this size, last layers first, each as soon as
        back-propagation has produced it (``tfgc.distribute.buckets``), and on the
        reduce-scatter a larger gradient in pieces of about this size; 0 reduces
        the whole step at once, after the backward pass.
      worker_rank: index of this worker's first replica among all replicas; seeds
        per-worker randomness.
      keys_index: the strategy's index among this process's strategies (the same on
        every worker): its pairwise exchanges take group keys of their own.
    """

    def __init__(self, devices, group_size, options, collective_keys=None,
                 canonicalize_devices=True, *, compressor="none", policy=None,
                 communication="auto", bucket_bytes=DEFAULT_BUCKET_BYTES,
                 overlap_bytes=DEFAULT_OVERLAP_BYTES, worker_rank=0, keys_index=0):
        self._compressor, self._policy = check_compression_args(
            compressor, policy, communication, bucket_bytes, overlap_bytes)
        self._communication = communication
        self._bucket_bytes = bucket_bytes
        self._overlap_bytes = overlap_bytes
        self._worker_rank = worker_rank
        self._keys_index = keys_index
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
        # compressor="auto": its plan, measured, kept and adapted.
        self._auto = autoplan.AutoPlanner(self, self._switched)
        self._uncompressed = []  # the last reduction's gradients sent as they are
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
        self._auto.reset()
        self._switched()

    @property
    def communication(self) -> str:
        return self._communication

    @communication.setter
    def communication(self, value):
        """Changes the path from the next step on (as the compressor switches); the
        compressor must fit it (set ``"auto"`` first to switch to one that does not)."""
        paths.check_communication(value, self._compressor)
        self._communication = value
        self._auto_choice = None
        self._switched()

    @property
    def bucket_bytes(self) -> int:
        return self._bucket_bytes

    @bucket_bytes.setter
    def bucket_bytes(self, value):
        """Changes the fused messages' bound from the next step on (as the compressor
        switches)."""
        self._bucket_bytes = check_int("bucket_bytes", value, 1)
        self._switched()

    @property
    def overlap_bytes(self) -> int:
        return self._overlap_bytes

    @overlap_bytes.setter
    def overlap_bytes(self, value):
        """Changes the buckets' size from the next step on (as the compressor switches)."""
        self._overlap_bytes = check_int("overlap_bytes", value, 0)
        self._switched()

    def _switched(self):
        """A setting changed: new train functions for registered Keras models, a failing
        guard for other functions traced before, and the settings exchanged again."""
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

    def uncompressed_gradients(self) -> List[dict]:
        """The gradients the last traced (or eager) reduction sent as they are: one dict
        each, ``variable`` (its name), ``bytes`` (None for embedding rows, whose number
        changes by step) and ``reason``. Their count and bytes per step are also in
        the statistics (``uncompressed_tensors``, ``uncompressed_bytes``)."""
        return [dict(entry) for entry in self._uncompressed]

    def plan(self):
        """Under ``compressor="auto"``, the plan the next step runs with
        (``tfgc.distribute.planner.Plan``: ``table()``, ``as_dicts()``); None before the
        first step, or under another compressor. Where the strategy reduces the
        gradients of more than one model (a GAN's two optimizers, models fitted in
        turn), each has a plan of its own (``plans``): this is that of the gradients
        reduced last."""
        return self._auto.plan

    def plans(self):
        """Under ``compressor="auto"``, the plan of each set of gradients planned in the
        current generation (one per model or optimizer, in the order first planned);
        [] before the first step, or under another compressor."""
        return self._auto.plans

    def states(self):
        """The live ``CompressionState`` objects (one per optimizer that trained)."""
        return list(self._states)

    def register_model(self, model):
        self._models.add(model)

    def settings(self) -> str:
        """What every worker must agree on, as one line (``tfgc.distribute.settings``)."""
        return settings_lib.line(self._compressor, self._policy, self._communication,
                                 self._bucket_bytes, self._overlap_bytes)

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

    def gather_words(self, words) -> np.ndarray:
        """All-gathers the same int32 ``words`` from every local replica (``gather_rows``);
        returns ``[group_size, len(words)]`` as NumPy. Eager; every worker must call it
        at the same point with as many words."""
        with tf.init_scope():
            rows = []
            for device in self._replica_devices:
                with tf.device(device):
                    rows.append(tf.constant(words, tf.int32))
            return self.gather_rows(rows).numpy()

    def time_all_reduce(self, nbytes: int, repeats: int = planner.REPEATS) -> float:
        """Median seconds of an all-reduce of ``nbytes`` of float32 across the cluster,
        after a warm-up (``repeats`` runs). Eager; every worker must call it at the same
        point with the same size and repeats."""
        with tf.init_scope():
            options = self._exchange_options()
            values = []
            for device in self._replica_devices:
                with tf.device(device):
                    values.append(tf.ones([max(nbytes // 4, 1)], tf.float32))

            def reduce_all():
                return [collectives.fused_all_reduce(launcher, [value], options)[0]
                        for launcher, value in zip(self._launchers, values)]

            if len(self._launchers) > 1:
                # Several local replicas must join the collective at once.
                reduce_all = tf.function(reduce_all, autograph=False)
            return planner.median_seconds(lambda: [r.numpy() for r in reduce_all()],
                                          repeats)

    def _exchange_settings(self):
        """Stops with a clear error if the workers' compression settings differ."""
        with self._settings_lock:
            if self._settings_checked == self._generation:
                return
            settings_lib.check_agree(self.gather_words(settings_lib.encode(self.settings())))
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
                # This worker's own, made past the variable creators (a strategy's, a
                # tf.function's): one that a function's first trace makes through them
                # has the function traced again, and a Keras 3 model (which builds its
                # optimizer before fit) paid that second trace on its first step.
                self._generation_var = resource_variable_ops.ResourceVariable(
                    tf.constant(self._generation, tf.int64), trainable=False,
                    name="tfgc_generation")
        return tf.debugging.assert_equal(
            self._generation_var.read_value(), tf.constant(self._generation, tf.int64),
            message="tfgc: the compressor was switched after this tf.function was traced "
                    "(or overlap_bytes changed); trace it again (a new tf.function) to use "
                    "the new setting")

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
        # Embedding gradients: compressed rows, a dense gradient on the path, or stock.
        modes = {i: embeddings.mode(compressor, self._policy, ctx.variables[i], v.values.dtype)
                 for i, v in enumerate(flat) if isinstance(v, tf.IndexedSlices)}
        # Under auto: the tables whose rows it may send, and those of them its plan
        # sends as dense gradients in this generation (``planner.plan_tables``).
        tables = []
        if compressor.plans_per_tensor:
            tables = [(i, flat[i]) for i in sorted(modes) if modes[i] == embeddings.ROWS]
            dense_tables = self._auto.dense_tables([ctx.variables[i] for i, _ in tables],
                                                   ctx.owner)
            for place, (i, _) in enumerate(tables):
                if place in dense_tables:
                    modes[i] = embeddings.DENSE
        flat = [embeddings.densify(v, ctx.variables[i]) if modes.get(i) == embeddings.DENSE
                else v for i, v in enumerate(flat)]
        slices_pos = [i for i, m in modes.items() if m != embeddings.DENSE]
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
        variables = [ctx.variables[i] for i in tensor_pos]
        tensors = [gradients.with_variable_shape(tf.convert_to_tensor(flat[i]), v)
                   for i, v in zip(tensor_pos, variables)]
        reasons = [self._policy.reason(t, compressor) for t in tensors]
        mask = [reason is None for reason in reasons]
        if compressor.needs_second_moment:
            mask = self._with_moments(compressor, variables, mask, replica_id)
        wire = WireBytes(n)
        for t, v, m, reason in zip(tensors, variables, mask, reasons):
            if not m or compressor.reduces_as_stock:
                reason = (f"compressor {compressor.name}" if m else
                          reason or "no per-sample second moment (not a MomentDense layer)")
                wire.uncompressed_gradient(paths.base.name_of(v), paths.base.nbytes(t), reason)

        if compressor.applied_momentum:
            momentum.check_momentum(ctx.owner, compressor)
        state = None
        planned, sent, plan = 0, None, None
        # Under auto, tables whose rows it may send are planned even with nothing else
        # to plan (a bag of embeddings under a small head): the plan says what the rows
        # go as.
        if (not any(mask) and not tables) or compressor.reduces_as_stock:
            # Nothing worth compressing (biases only, float64), or identity: the stock
            # strategy's own all-reduce, as it is.
            carried = []
            if any(mask):
                # Identity keeps a state as any compressor does (a slot per kernel, the
                # step counter, advanced once a step), so checkpoints and a switch to
                # another compressor find what they expect.
                state = self._state_for(ctx.owner, compressor, variables, mask)
                with tf.device(device):
                    tensors, carried = _take_carried(state, tensors, variables, replica_id)
            reduced = super()._all_reduce(tf.distribute.ReduceOp.SUM, tensors, replica_id,
                                          options) if tensors else []
            for t in tensors:
                wire.allreduce(paths.base.nbytes(t), dense=paths.base.nbytes(t))
            ok = None
            if state is not None:
                with tf.device(device):
                    _let_go(state, carried, reduced, ok, replica_id)
                    state.step(replica_id).assign_add(1)
        elif compressor.plans_per_tensor:
            reduced, ok, state, planned, sent, plan = self._planned_reduce(
                ctx.owner, tensors, variables, mask, replica_id, options, wire, tensor_pos,
                [(i, ctx.variables[i], s.values.dtype) for i, s in tables])
        else:
            self._choose(tensors, mask)
            path = paths.PATHS[self._path()]
            state = self._state_for(ctx.owner, compressor, variables, mask)
            guard = self._generation_guard()
            with tf.device(device), \
                    tf.control_dependencies([guard] if guard is not None else []):
                tensors, carried = _take_carried(state, tensors, variables, replica_id)
                step = paths.ReductionStep(
                    compressor=compressor, tensors=tensors, variables=variables, mask=mask,
                    state=state, step_var=state.step(replica_id), launcher=launcher,
                    rank=rank, replica_id=replica_id, options=options, wire=wire,
                    num_workers=n, bucket_bytes=self._bucket_bytes, path=path.name,
                    piece_bytes=self._overlap_bytes,
                    exchanger=lambda: self._exchanger(replica_id),
                    second_moments=self._second_moments.get(replica_id, {}))
                unfuse = None
                overlap = self._overlap_bytes
                if compressor.fuses_gradients:
                    # One vector per dtype (gradient dropping's global threshold): one
                    # bucket, after the whole backward pass.
                    fused_t, fused_v, fused_m, unfuse = fusion.fuse(tensors, variables, mask)
                    step = step.replace(tensors=fused_t, variables=fused_v, mask=fused_m,
                                        state=fusion.FusedState(state))
                    overlap = 0
                stages = compressor.stages()
                if stages:
                    reduced, ok = self._staged_reduce(stages, path, step, overlap,
                                                      compressor.stage_period)
                else:
                    reduced, ok = buckets.reduce(path, step, overlap)
                if unfuse is not None:
                    reduced = unfuse(reduced)
                _let_go(state, carried, reduced, ok, replica_id)
        if compressor.applied_momentum and tensors:
            if state is None:
                state = self._state_for(ctx.owner, compressor, variables, mask)
            with tf.device(device):
                reduced = momentum.dense_momentum(compressor, state, variables, mask, reduced,
                                                  ok, replica_id)
        for i, r in zip(tensor_pos, reduced):
            results[i] = r

        rows_pos = [i for i in slices_pos if modes[i] == embeddings.ROWS]
        row_compressor, planned_stock = compressor, set()
        if rows_pos and compressor.plans_per_tensor:
            row_compressor = self._auto.row_compressor(plan)
            if row_compressor is None:
                # Everything planned as float32, or one worker: the rows too.
                for i in rows_pos:
                    modes[i] = embeddings.STOCK
                planned_stock, rows_pos = set(rows_pos), []
        if rows_pos and state is None:
            state = self._state_for(ctx.owner, compressor, variables, mask)
        # A residual kept from a compressor that sent a table's gradient densified: its
        # rows that hold anything go with this step's rows, until a step commits.
        rows_carried = []
        if state is not None:
            for i in slices_pos:
                residual = state.carried(ctx.variables[i], replica_id)
                if residual is not None:
                    flag = state.carried_rows_pending(ctx.variables[i], replica_id)
                    with tf.device(device):
                        pending = flag.read_value()
                        flat[i] = _with_carried_rows(flat[i], residual, pending)
                    rows_carried.append((i, residual, flag, pending))
        if rows_pos:
            step_var = state.step(replica_id)
            with tf.device(device):
                reduced_rows, rows_ok = embeddings.reduce_rows(
                    row_compressor, [flat[i] for i in rows_pos],
                    [ctx.variables[i] for i in rows_pos], step_var.read_value(), launcher,
                    rank, n, options, wire)
                if plan is None and not any(mask):
                    # No path advanced the step counter (it seeds the next draws).
                    step_var.assign_add(tf.cast(rows_ok, step_var.dtype))
            ok = rows_ok if ok is None else tf.logical_and(ok, rows_ok)
            for i, r in zip(rows_pos, reduced_rows):
                results[i] = r
        stock_pos = [i for i in slices_pos if modes[i] == embeddings.STOCK]
        if stock_pos:
            slices = [flat[i] for i in stock_pos]
            reduced_slices = super()._all_reduce(tf.distribute.ReduceOp.SUM, slices, replica_id,
                                                 options)
            for i, s, r in zip(stock_pos, slices, reduced_slices):
                results[i] = r
                dense = int(np.prod(ctx.variables[i].shape)) * s.values.dtype.size
                wire.indexed_slices(s, dense)
                reason = ("auto's plan: float32, embedding rows on the stock gather"
                          if i in planned_stock else
                          embeddings.stock_reason(compressor, self._policy, ctx.variables[i],
                                                  s.values.dtype))
                wire.uncompressed_gradient(paths.base.name_of(ctx.variables[i]),
                                           wire.dynamic[-1], reason)
        if rows_carried:
            with tf.device(device):
                _let_go_rows(rows_carried, [results[i] for i, _, _, _ in rows_carried], ok)
        if sent is not None:
            # After the rows: a step that their values skip adds nothing to the sums.
            with tf.device(device):
                self._auto.track(plan, sent, variables, mask, reduced, replica_id, ok)
        if tables and plan is not None:
            with tf.device(device):
                self._auto.track_tables(
                    plan, [s for _, s in tables], [ctx.variables[i] for i, _ in tables],
                    [None if modes[i] == embeddings.DENSE else results[i] for i, _ in tables],
                    ok, replica_id)

        if replica_id == 0:
            self._uncompressed = [
                {"variable": name, "bytes": b if isinstance(b, int) else None, "reason": why}
                for name, b, why in wire.uncompressed]
            self._stats.record(wire, ok)
            if not tf.executing_eagerly():
                compressed = planned if compressor.plans_per_tensor else sum(mask)
                wire.log_trace(compressed + len(rows_pos), len(flat), compressor,
                               "its planned paths" if compressor.plans_per_tensor
                               else paths.PATHS[self._path()].describe)
        return results

    # -- compressor="auto" ----------------------------------------------------------

    @property
    def generation(self) -> int:
        """Goes up with every change of setting (each retraces the train functions)."""
        return self._generation

    def replan(self, margin: float = 0.25, due=None) -> bool:
        """Under ``compressor="auto"``: measures the link again and, if the float32
        all-reduce of the planned gradients that it predicts moved by more than
        ``margin`` (relative) since the plan's measurement, plans again with the new
        figures (the CPU's are kept). Every worker must call it at the same point, after
        a step (``tfgc.keras.AutoPlanCallback`` does, at the end of each interval).
        ``due`` (a bool on every worker, or None on every worker): whether the link is
        to be measured now; worker 0's is followed (all-gathered), so a worker whose
        clock says otherwise still does as the others. None: measured.
        Returns whether the plan changed; a new plan takes effect at the next step."""
        return self._auto_planner("replan").replan(margin, due)

    def track_regimes(self):
        """Under ``compressor="auto"``: from the next step on, worker 0 sums every
        planned gradient over the interval (a variable of its shape each) and its
        squared norm (a scalar), and every
        gradient is treated as in a critical regime until ``adapt`` says otherwise.
        Called again (``AutoPlanCallback`` does at each fit's start), it marks every
        set of gradients as not trained yet in this fit (``adapt`` and
        ``measure_low_rank`` leave alone those no step summed)."""
        self._auto_planner("track_regimes").track_regimes()

    def adapt(self, threshold: float = 0.5, min_gain_s: float = 0.0, step_s=None,
              step_se_s=None, steps_left=None, learning_rate=None,
              trial_steps=None, noise: float = 1.0) -> frozenset:
        """Under ``compressor="auto"`` after ``track_regimes``: ends an interval. The norm
        of each planned gradient's mean over the interval is compared with the previous
        interval's (``planner.critical_layers``: a change of ``threshold`` or more, and
        of more than ``noise`` times the two intervals' noise, estimated from the
        steps' squared norms, or no previous norm, is a critical regime; ``noise`` 0:
        ACCORDION's bare test), the sums restart, and the plan is made
        again, critical ones limited to bf16's error. A new plan whose predicted step
        (``Plan.paced_seconds``, under the measured pace and the paces at both ends of
        its slope's interval: ``planner.change_pays``) is less than ``min_gain_s``
        seconds shorter than the current plan's (priced anew; twice that while the
        steps have measured no slope: ``planner.required_gain``, or where it is a
        trial, saving twice that at the measured pace, with what it would lose over
        ``trial_steps`` steps at the worst pace its slope allows, and nothing less
        within one standard error of its slope: ``planner.is_trial``) is not taken
        while the current one still keeps within the regimes and budgets
        (``AutoPlanCallback`` passes what a change cost the last time, or the fit's
        first trace until one is timed, spread over the rest of the fit).
        ``step_s``: the current plan's measured step in seconds (its median; None: not
        timed), which weighs the low-rank error's extra steps against the time a step
        saves (``planner.Pace``), and ``step_se_s`` its standard error (None: unknown,
        taken as ``planner.PACE_PRIOR`` of the step), which weighs the plan's step in
        the pace and bounds its slope. ``steps_left``: the steps left of training
        (None: unknown), over which timing the low-rank and top-k candidates must be
        able to pay for itself before it is done (as for ``measure_low_rank``).
        ``learning_rate``: the rate the optimizer gives its next step (None: unknown);
        where it fell by ``threshold`` or more since the previous interval's end
        (``planner.learning_rate_fell``: ACCORDION's rule at a decay), every gradient
        the interval trained is critical for the next interval and held: no lossier
        than the plan that ran sent it (``planner.make_plan``'s ``held``).
        ``trial_steps``: the steps a plan taken as a trial runs before its own steps
        are weighed (``AutoPlanCallback``: its interval; None: not priced), of the
        ``steps_left`` (or, where fewer or unknown, of its own) that a change pays
        over (``planner.trial_share_of``). The norms, ``min_gain_s``, the step,
        ``steps_left``, ``trial_steps`` and the rate are worker 0's
        (all-gathered), so every worker decides the same; every worker must call it at
        the same point. Returns the names in a critical regime now, of the models the
        interval trained: one whose every step was skipped for a non-finite gradient
        keeps the regimes it had."""
        return self._auto_planner("adapt").adapt(threshold, min_gain_s, step_s, step_se_s,
                                                 steps_left, learning_rate, trial_steps,
                                                 noise)

    def measure_low_rank(self, step_s=None, step_se_s=None, steps_left=None,
                         min_gain_s: float = 0.0, trial_steps=None) -> bool:
        """Under ``compressor="auto"`` with regimes tracked and ``low_rank`` on: measures
        every matrix's low-rank error now (on the last step's gradients, as ``adapt``
        does at an interval's end) and plans again; True when the plan changed.
        ``step_s``, ``step_se_s``, ``min_gain_s`` and ``trial_steps`` as for ``adapt``
        (worker 0's).
        The first time, it also times the low-rank and top-k candidates' CPU cost
        (seconds with a cold cache: ``planner.measured_timing_s``), unless what the
        matrices cost a step now, over ``steps_left`` steps (worker 0's; None: unknown),
        is less than the timing would take (``planner.timing_pays``): then neither
        is measured, those candidates are not planned, and ``low_rank_untimed`` says why
        (``adapt`` asks again at every interval's end).
        ``tfgc.keras.AutoPlanCallback`` calls it once the first plan's steps have been
        timed, so that low rank need not wait for an interval. Eager; every worker must
        call it at the same point."""
        return self._auto_planner("measure_low_rank").measure_low_rank(
            step_s, step_se_s, steps_left, min_gain_s, trial_steps)

    @property
    def measuring_s(self) -> float:
        """Under ``compressor="auto"``: the seconds this process spent measuring the link
        and the CPU inside plans' first steps (their traces), a restored plan's probe of
        the link included."""
        return self._auto.measuring_s

    def low_rank_untimed(self):
        """Under ``compressor="auto"``: why the low-rank and top-k candidates are left
        untimed, and so unplanned (the line logged when ``measure_low_rank`` or
        ``adapt`` first left them so; each interval's end asks again), or None where
        they were timed, or not asked for yet."""
        return self._auto_planner("low_rank_untimed").untimed

    def pin_plan(self, choice) -> bool:
        """Under ``compressor="auto"``: sends the gradients as ``choice`` says from the
        next step on, instead of the planner's choice, to compare plans on a model or
        to keep one known to work. ``choice``: a candidate's label
        (``tfgc.distribute.planner.BY_LABEL``: fp32, bf16, rqsgd8, qsgd8, rqsgd4,
        psgd1, psgd2, psgd4, psgd8, topk1) for every gradient, or a dict of labels by
        gradient name (those of ``plan()``'s entries, so after a step; the gradients
        not named go as fp32); None gives the choice back to the planner, which plans
        afresh (where nothing is pinned, None changes nothing). A gradient
        that the label does not take (PowerSGD's a vector) goes as float32, and says
        so in the plan and in ``uncompressed_gradients``. Embedding tables go as the
        rows a step touched, in the pinned label where it is a quantizer (a dict: the
        first table's), else as float32 on the stock gather. The pin overrides the
        error budgets and the critical regimes (its plan reports the low-rank error it
        uses, where measured); ``replan``, ``adapt`` and ``measure_low_rank`` still
        measure, time and track, and price the pinned plan anew, but do not change
        it. Pinning a low-rank or top-k label measures their CPU cost first, where not
        measured yet. A checkpoint keeps the pinned plan's figures, regimes and timed
        steps, not the pin: restored, the planner plans afresh. Setting the
        ``compressor`` again (``"auto"`` too) gives the choice back. Every worker must
        call it at the same point, between steps, with the same ``choice``: the
        workers compare theirs first, and all raise ValueError where one refused its
        choice or they differ. Returns whether the plan changed (then the next step
        retraces); False before the first step, whose plan follows the pin."""
        return self._auto_planner("pin_plan").pin(choice)

    def capture_gradients(self):
        """Under ``compressor="auto"`` with ``low_rank`` on: the next step keeps each
        matrix's local gradient for the next ``measure_low_rank`` or ``adapt`` (the first
        step after ``track_regimes`` keeps them anyway; each measurement stops it).
        ``AutoPlanCallback`` calls it before the last step of each interval."""
        self._auto_planner("capture_gradients").capture()

    def _auto_planner(self, what):
        if not self._compressor.plans_per_tensor:
            raise ValueError(f"{what}() is for compressor='auto', not {self._compressor!r}")
        return self._auto

    def _planned_reduce(self, owner, tensors, variables, mask, replica_id, options, wire,
                        positions, tables):
        """The gradients in ``mask`` as the plan says, in groups by candidate, each on its
        path and in buckets, one decision for the whole step (``positions``: their
        indices among all the gradients; ``tables``: the embedding tables the plan
        covers, ``AutoPlanner.plan_for``). Returns ``(reduced, ok, state, how many
        gradients it compressed, the tensors sent, the plan)``: the caller hands them to
        ``AutoPlanner.track`` with the step's decision once the rows are reduced too."""
        n = self._num_replicas
        plan = self._auto.plan_for(tensors, variables, mask, owner, positions, tables)
        planned = [i for i, m in enumerate(mask) if m]
        entries = dict(zip(planned, plan.entries))
        groups = {}
        for i, entry in entries.items():
            if entry.candidate.spec is None:
                wire.uncompressed_gradient(paths.base.name_of(variables[i]),
                                           paths.base.nbytes(tensors[i]),
                                           f"auto's plan: {entry.reason}")
            else:
                groups.setdefault(entry.label, []).append(i)
        compressors = {label: planner.BY_LABEL[label].compressor for label in groups}
        layouts = [paths.PATHS[entries[i].path].state_layout(compressors[entries[i].label], n)
                   if i in entries and entries[i].label in groups else None
                   for i in range(len(tensors))]
        state = self._register_state(owner, layouts, plan.key(), variables,
                                     [layout is not None for layout in layouts])
        step_var = state.step(replica_id)
        device = self._replica_devices[replica_id]
        guard_op = self._generation_guard()
        with tf.device(device), \
                tf.control_dependencies([guard_op] if guard_op is not None else []):
            # A residual that a change of plan took off error feedback goes out with
            # this step's gradient, and is zeroed once the step commits.
            tensors, carried = _take_carried(state, tensors, variables, replica_id)
            commit = paths.guard.StepCommit()
            base = paths.ReductionStep(
                compressor=None, tensors=tensors, variables=variables, mask=[False] * len(tensors),
                state=state, step_var=step_var, launcher=self._launchers[replica_id],
                rank=self._worker_rank + replica_id, replica_id=replica_id, options=options,
                wire=wire, num_workers=n, bucket_bytes=self._bucket_bytes, path="allreduce",
                piece_bytes=self._overlap_bytes, exchanger=lambda: self._exchanger(replica_id),
                commit=commit)
            work = []
            # Candidates in their fixed order; each draws its randomness apart.
            for g, label in enumerate(c.label for c in planner.ALL if c.label in groups):
                positions = groups[label]
                path = paths.PATHS[entries[positions[0]].path]
                work.append((path, base.replace(
                    compressor=compressors[label], tensors=[tensors[i] for i in positions],
                    variables=[variables[i] for i in positions], mask=[True] * len(positions),
                    path=path.name, first_index=g << 16), positions))
            grouped = {i for _, _, positions in work for i in positions}
            dense = [i for i in range(len(tensors)) if i not in grouped]
            if work:
                outputs = buckets.reduce_groups(
                    work, self._overlap_bytes, [(i, tensors[i], variables[i]) for i in dense])
                reduced, ok = commit.finish(step_var, [outputs[i] for i in range(len(tensors))])
            else:
                outputs = paths.base.reduce_dense(base, dense)
                reduced = [outputs[i] for i in range(len(tensors))]
                # All float32: the counter still counts the step, as identity's does.
                with tf.control_dependencies(reduced):
                    step_var.assign_add(1)
                ok = None
            _let_go(state, carried, reduced, ok, replica_id)
        return reduced, ok, state, len(grouped), tensors, plan

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

    def _state_for(self, owner, compressor, variables, mask):
        """The owner's compression state, registered for ``variables`` on this path."""
        layout = paths.PATHS[self._path()].state_layout(compressor, self._num_replicas)
        return self._register_state(owner, layout, repr(serialize_config(compressor)),
                                    variables, mask)

    def _register_state(self, owner, layouts, key, variables, mask):
        """``state_lib.state_for`` (one layout, or one per variable), kept among the live
        states."""
        state = state_lib.state_for(owner, self, layouts, key, variables, mask)
        self._states.add(state)
        return state

    def _staged_reduce(self, stages, path, reduction, overlap_bytes, period=0):
        """Runs the stage of ``stages`` that the step counter is in (DGC's warm-up).

        Each stage is its own branch of a ``tf.switch_case`` with its own static
        payload sizes and collectives, reduced in buckets inside the branch (a
        lowered branch's ops wait for the branch index and their own inputs only);
        the counter is the same on every worker, so all take the same branch. The
        branch reports its byte figures.
        """
        step = reduction.step_var.read_value()
        if period:
            # Stages that repeat (GradiVeQ's windows): the position in the cycle.
            step = tf.math.floormod(step, tf.cast(period, step.dtype))
        index = tf.add_n([tf.cast(step >= first, tf.int32) for first, _ in stages[1:]])
        dense = []

        def branch(stage_compressor):
            def run():
                w = WireBytes(self._num_replicas)
                outs, ok = buckets.reduce(
                    path, reduction.replace(compressor=stage_compressor, wire=w), overlap_bytes)
                dense.append(w.dense)
                sent = tf.constant(w.static_sent, tf.int64)
                if w.dynamic_sent:
                    sent += tf.add_n(w.dynamic_sent)
                ok = tf.constant(True) if ok is None else ok
                return list(outs), ok, tf.constant(w.payload, tf.int64), sent
            return run

        outs, ok, payload, sent = tf.switch_case(index, [branch(c) for _, c in stages])
        reduction.wire.at_run_time(dense[-1], payload, sent)
        return list(outs), ok

    def _exchanger(self, replica_id):
        if replica_id not in self._exchangers:
            self._exchangers[replica_id] = collectives.PairExchanger(
                self._worker_rank + replica_id, self._num_replicas,
                self._replica_devices[replica_id], self._comm_options, self._keys_index)
        return self._exchangers[replica_id]

    # -- copying -------------------------------------------------------------------

    def __deepcopy__(self, memo):
        # distribute_coordinator deep-copies strategies; keep the class and settings.
        return CompressedAllReduce(
            self._replica_devices, self._num_replicas, self._comm_options,
            copy.deepcopy(self._keys, memo), self._canonicalize,
            compressor=self._compressor, policy=self._policy,
            communication=self._communication, bucket_bytes=self._bucket_bytes,
            overlap_bytes=self._overlap_bytes, worker_rank=self._worker_rank,
            keys_index=self._keys_index)
