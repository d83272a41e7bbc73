"""``CompressedMultiWorkerMirroredStrategy``: MultiWorkerMirroredStrategy with compression."""

import itertools
import os
import sys
import threading

import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import collective_all_reduce_strategy as mwms_lib
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context

from tfgc.distribute import iterators
from tfgc.distribute import keras_hooks
from tfgc.distribute import state as state_lib
from tfgc.distribute import versions
from tfgc.distribute.cross_device_ops import (DEFAULT_BUCKET_BYTES, DEFAULT_OVERLAP_BYTES,
                                              CompressedAllReduce,
                                              check_compression_args)


versions.warn_if_unchecked()


class _CompressedExtended(mwms_lib.CollectiveAllReduceExtended):
    """Swaps the strategy's cross-device ops for ``CompressedAllReduce``.

    The parent builds a stock ``CollectiveAllReduce`` while it sets up local or
    multi-worker collectives; right after, we build ours on the same devices, group
    size and collective keys. Host-side reductions keep the stock ops.
    """

    def __init__(self, container_strategy, cluster_resolver, communication_options,
                 compression_kwargs):
        self._compression_kwargs = compression_kwargs
        super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                         communication_options=communication_options)

    def _install_compression(self, worker_index):
        stock = self._cross_device_ops
        self._cross_device_ops = CompressedAllReduce(
            devices=stock._devices,  # pylint: disable=protected-access
            group_size=stock._group_size,  # pylint: disable=protected-access
            options=self._communication_options,
            collective_keys=self._collective_keys,
            worker_rank=worker_index * len(stock._devices),  # pylint: disable=protected-access
            keys_index=self._collective_key_base // _KEY_RANGE,
            **self._compression_kwargs)

    def _initialize_local(self, cluster_resolver, devices=None):
        super()._initialize_local(cluster_resolver, devices=devices)
        self._install_compression(0)

    def _initialize_multi_worker(self, cluster_resolver):
        served = _served_collectives(cluster_resolver)
        if served is not None:
            # This process's server already serves this cluster, task and protocol (a
            # strategy built before this one): the parent would enable collective ops a
            # second time, which resets the runtime under the first strategy's
            # collectives (TensorFlow warns of it) and, on 3 workers, left a second
            # strategy's first step waiting forever. Reuse the server instead; with a
            # coordination service its heartbeats detect dead peers, as the parent
            # decides when it starts the server.
            self._std_server_started = True
            if served.default_session_config.experimental.coordination_config.service_type:
                self._enable_check_health = False
        super()._initialize_multi_worker(cluster_resolver)
        worker_index = multi_worker_util.id_in_cluster(
            self._cluster_spec, self._task_type, self._task_id)
        self._install_compression(worker_index)


def _served_collectives(cluster_resolver):
    """The server definition with which this process already enabled collective ops,
    when it serves ``cluster_resolver``'s cluster, task and protocol; else None."""
    server_def = context.context()._collective_ops_server_def  # pylint: disable=protected-access
    if server_def is None or cluster_resolver is None:
        return None
    if cluster_resolver.task_type is None or cluster_resolver.task_id is None:
        return None
    cluster = multi_worker_util.normalize_cluster_spec(cluster_resolver.cluster_spec())
    same = (server_def.cluster == cluster.as_cluster_def()
            and server_def.job_name == cluster_resolver.task_type
            and server_def.task_index == cluster_resolver.task_id
            and server_def.protocol == (cluster_resolver.rpc_layer or "grpc"))
    return server_def if same else None


# Collective keys: every strategy of a process gets a range of its own. The
# stock strategy starts every instance at the same group key, so a second one in
# the same process (a notebook trying another compressor) reuses the first one's
# groups and instance keys, and its collectives meet the first one's in the
# runtime (a shape mismatch). Workers build their strategies in the same order,
# so the n-th strategy has the same range on every worker. The ranges start at the
# second: the first (from key 1) is every stock strategy's, and a stock
# MultiWorkerMirroredStrategy built before ours in the same process (a comparison in
# one notebook) failed our first all-gather with "Collective instance ... expected type
# 1 ... but got type 2". A strategy's index in that order (``keys_index``) also sets
# apart the group keys of its pairwise exchanges (``collectives.PairExchanger``), which
# are not drawn from the range.
_KEY_RANGE = 100_000
_strategy_count = itertools.count(1)
_count_lock = threading.Lock()


def _next_key_base(base):
    with _count_lock:
        return base + _KEY_RANGE * next(_strategy_count)


_single_worker_noted = False


def _note_single_worker(cluster_resolver):
    """Says once per process that a strategy without a cluster trains alone: gradients
    still pass through the compressor, but nothing crosses a network, so the sent-byte
    counters (and the wire ratio) read 0."""
    global _single_worker_noted
    if _single_worker_noted:
        return
    _single_worker_noted = True
    why = ("TF_CONFIG is not set" if cluster_resolver is None and not os.environ.get("TF_CONFIG")
           else "the cluster has one worker")
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    command = (f"python {script}" if script.endswith(".py") else "python your_script.py")
    logging.warning(
        "tfgc: %s, so this strategy trains as a single worker: gradients pass through "
        "the compressor but cross no network, so sent bytes and the wire ratio read 0. "
        "To train on several workers, start them with `tfgc-launch --workers N -- %s` "
        "(local; tfgc-train takes --workers N itself), or set TF_CONFIG on each machine.",
        why, command)


class CompressedMultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """``tf.distribute.MultiWorkerMirroredStrategy`` whose gradients cross the network compressed.

    Use it exactly like the stock strategy; the cluster comes from ``TF_CONFIG`` (or
    ``cluster_resolver``), and without one it runs as a single worker::

        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="ef+topk:ratio=0.01")
        with strategy.scope():
            model = build_model()
            model.compile(optimizer="sgd", loss=...)
        model.fit(dataset, callbacks=[tfgc.keras.CompressionStatsCallback(strategy)])

    Args:
      compressor: a compressor, registry string (``"qsgd:levels=7"``,
        ``"ef+topk:ratio=0.001"``) or config dict. Default ``"none"`` (exact).
        ``"auto"`` plans each gradient (float32, bf16, 8- or 4-bit QSGD) from the link
        and CPU it measures at the first step, under an error budget
        (``tfgc.compressors.Auto``); ``compression_plan()`` shows the plan.
      cluster_resolver: as for ``MultiWorkerMirroredStrategy``.
      communication_options: as for ``MultiWorkerMirroredStrategy``.
      policy: a ``tfgc.CompressionPolicy`` choosing which gradients to compress.
      communication: "auto" (the path with the fewest bytes on the wire for this
        compressor and cluster size, logged once), "allreduce" (summable
        compressors only), "allgather", "reduce_scatter" (quantizers: each worker
        owns a chunk, decodes and sums it and compresses the sum again, with error
        feedback at both stages), "shared_index" (top-k: one worker's index set,
        chosen in rotation, serves every worker, and the values are summed by the
        dense all-reduce) or "sparse_allreduce" (top-k: every worker's set, merged
        by recursive doubling with a dense switch).
      bucket_bytes: largest per-worker size of one fused all-gather.
      overlap_bytes: gradient bytes per bucket. A step's gradients are compressed,
        reduced and decoded in buckets of about this size, last layers first, each
        as soon as back-propagation has produced it, so communication overlaps the
        rest of the backward pass; one decision (all finite on every worker) still
        holds for the whole step. On the reduce-scatter a larger gradient is also
        cut into pieces of about this size (at least 1 MiB), each compressed, sent
        and decoded on its own. 0: one bucket, after the whole backward pass.

    Invalid arguments raise ``ValueError`` here, before any worker connects.
    """

    # What tfgc's Keras hooks look for (keras_hooks._compressed_strategy).
    compresses_gradients = True

    def __init__(self, compressor="none", cluster_resolver=None, communication_options=None,
                 policy=None, communication="auto", bucket_bytes=DEFAULT_BUCKET_BYTES,
                 overlap_bytes=DEFAULT_OVERLAP_BYTES):
        # Everything is checked here, before the parent starts a server and waits
        # for the other workers.
        compressor, policy = check_compression_args(compressor, policy, communication,
                                                    bucket_bytes, overlap_bytes)
        if communication_options is None:
            communication_options = tf.distribute.experimental.CommunicationOptions()
        kwargs = dict(compressor=compressor, policy=policy, communication=communication,
                      bucket_bytes=bucket_bytes, overlap_bytes=overlap_bytes)
        # Keras optimizers name their variables to us; Keras models get rebuilt
        # train functions when the compressor is switched.
        keras_hooks.install()
        # Read by the parent's extended class when it creates the collective keys.
        self._collective_key_base = _next_key_base(type(self)._collective_key_base)
        # The parent's __init__ hard-codes its own extended class; build ours and
        # hand it to the common Strategy base instead.
        distribute_lib.Strategy.__init__(  # pylint: disable=non-parent-init-called
            self, _CompressedExtended(self, cluster_resolver, communication_options, kwargs))
        if self.num_replicas_in_sync == 1:
            _note_single_worker(cluster_resolver)

    def experimental_distribute_dataset(self, dataset, options=None):
        """``tf.distribute.Strategy.experimental_distribute_dataset``, whose iterators
        are torn down on a thread of their own when dropped (``iterators``: TensorFlow
        can take seconds there, and ``model.fit`` made its caller and the other
        workers wait)."""
        return iterators.distribute(super().experimental_distribute_dataset(dataset, options))

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``tf.distribute.Strategy.distribute_datasets_from_function``, with the
        iterators of ``experimental_distribute_dataset``."""
        return iterators.distribute(
            super().distribute_datasets_from_function(dataset_fn, options))

    def reduce(self, reduce_op, value, axis=None):
        """``tf.distribute.Strategy.reduce``, also for what Keras 3's ``model.fit`` asks.

        Keras 3 (TensorFlow backend) calls it, on a multi-worker strategy, with
        what the stock strategy rejects: a whole batch (a tuple of per-replica
        values) before the first step, and ``axis=0`` on the scalar logs of
        every step (keras-team/keras#20585). A nest is reduced leaf by leaf,
        and ``axis`` is ignored for rank-0 values, which have no batch axis to
        reduce: their reduction over the replicas is the whole of it.
        Everything else goes to the stock method unchanged.
        """
        if isinstance(value, (tuple, list, dict)):
            return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
        if axis is not None:
            local = self.experimental_local_results(value)
            if local and getattr(local[0], "shape", None) is not None and local[0].shape.rank == 0:
                axis = None
        return super().reduce(reduce_op, value, axis)

    @property
    def cross_device_ops(self) -> CompressedAllReduce:
        return self.extended._cross_device_ops  # pylint: disable=protected-access

    @property
    def compressor(self):
        return self.cross_device_ops.compressor

    @compressor.setter
    def compressor(self, value):
        """Switches compressor from the next training step on.

        Keras models trained under this strategy get a new train function, also in
        the middle of ``fit`` (e.g. from a callback). A custom ``tf.function``
        traced before the switch fails at its next call and must be traced again.
        Residuals carry over to the new compressor; other state starts fresh.
        """
        self.cross_device_ops.compressor = value

    @property
    def bucket_bytes(self) -> int:
        return self.cross_device_ops.bucket_bytes

    @bucket_bytes.setter
    def bucket_bytes(self, value):
        """Changes the largest fused message from the next training step on, as
        ``overlap_bytes`` does. Every worker must set the same value."""
        self.cross_device_ops.bucket_bytes = value

    @property
    def overlap_bytes(self) -> int:
        return self.cross_device_ops.overlap_bytes

    @overlap_bytes.setter
    def overlap_bytes(self, value):
        """Changes the buckets' size from the next training step on, as ``compressor``
        switches: Keras models get a new train function, a custom ``tf.function``
        must be traced again. Every worker must set the same value."""
        self.cross_device_ops.overlap_bytes = value

    def _register_model(self, model):
        self.cross_device_ops.register_model(model)

    @property
    def worker_index(self) -> int:
        """This worker's index in the cluster (0 for a single worker)."""
        extended = self.extended
        if not getattr(extended, "_cluster_spec", None):
            return 0
        return multi_worker_util.id_in_cluster(
            extended._cluster_spec, extended._task_type, extended._task_id)  # pylint: disable=protected-access

    def compression_stats(self):
        """Bytes of the last reduction and totals, as a dict of Python numbers."""
        return self.cross_device_ops.stats.result()

    def uncompressed_gradients(self):
        """The gradients the last reduction sent as they are, each with its reason
        (``CompressedAllReduce.uncompressed_gradients``)."""
        return self.cross_device_ops.uncompressed_gradients()

    def compression_plan(self):
        """Under ``compressor="auto"``: what each gradient is sent as, and why
        (``tfgc.distribute.planner.Plan``; ``table()`` prints it), or None before the
        first step, under another compressor, or where the policy sends every gradient
        as it is (none large enough, and no embedding table; ``uncompressed_gradients``
        says why). A strategy that reduces the gradients of more than one model or
        optimizer (a GAN) plans each apart: this is the plan of those reduced last,
        ``compression_plans()`` lists them all."""
        return self.cross_device_ops.plan()

    def compression_plans(self):
        """Under ``compressor="auto"``: the plan of each set of gradients planned under
        the current settings (a GAN's generator and discriminator each have one;
        models trained one after another too, the last four at least), in the order
        they were first planned; [] before the first step, under another compressor,
        or where nothing is planned (``compression_plan``)."""
        return self.cross_device_ops.plans()

    def compression_state(self, owner=None):
        """This worker's compressor state (residuals, counters).

        With ``owner`` (an optimizer): the ``tfgc.distribute.CompressionState``
        attached to it, or None before its first step. Without: a list of every
        live state of this strategy, one per optimizer that has trained.
        """
        if owner is not None:
            return state_lib.get_state(owner)
        return self.cross_device_ops.states()

    def reset_compression_state(self, owner=None):
        """Zeroes residuals and counters of ``owner`` (or of every optimizer) on this worker.

        Every worker must do the same: workers whose step counters differ stop
        at the next step with an error.
        """
        states = [self.compression_state(owner)] if owner is not None else self.compression_state()
        for s in states:
            if s is not None:
                s.reset()
