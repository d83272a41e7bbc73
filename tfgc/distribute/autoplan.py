"""``compressor="auto"`` in a running strategy: its plan measured, made, checked, kept
and adapted (``AutoPlanner``); what a plan is and how it is chosen is ``planner``.

The cross-device ops hold one ``AutoPlanner`` and ask it for the plan of each traced
gradient reduction (``plan_for``). A plan belongs to the ops' *generation* (it goes
up with every change of setting, and each change retraces the train functions):
the first trace of a generation measures (every worker at once: the figures need
collectives) and plans, later traces of the same gradients reuse the plan. Between
steps, ``replan`` (the link measured again) and ``adapt`` (the end of an interval of
training: ACCORDION's critical regimes) may make a new plan, which ``_adopt`` hands to
the next step by starting a new generation with the plan and figures ready, so that
trace measures nothing.

Checkpoints: the owner of the compression state (the optimizer) also tracks a
``PlanRecord``, which saves what the plan was made from (the gradients, the agreed
figures, the critical set and the last norms) and its key. Restored before the first
step (Keras' ``BackupAndRestore``, a ``tf.train.Checkpoint`` restored into a new
optimizer), it reaches the planner when the record is attached, just before the first
plan, and that plan is made from the saved figures instead of measuring again: the same
plan as before the restart, when the code is the same. The workers first agree that
they all restored the same figures (an all-gather of their checksums); otherwise they
all measure.
"""

import json
import time
import weakref
import zlib

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.trackable import base as trackable

from tfgc.compressors.base import check_number
from tfgc.distribute import planner
from tfgc.distribute import state as state_lib
from tfgc.distribute.paths import base

# The record's name among the owner's checkpoint dependencies.
RECORD_NAME = "tfgc_auto_plan"
_RECORD_FORMAT = 1


class PlanRecord(trackable.Trackable):
    """What a plan was made from, in a checkpoint (see the module docstring)."""

    def __init__(self, auto_planner):
        self._planner_ref = weakref.ref(auto_planner)

    def _serialize_to_tensors(self):
        auto_planner = self._planner_ref()
        record = auto_planner.snapshot() if auto_planner is not None else {}
        return {"plan": tf.constant(json.dumps(record, sort_keys=True))}

    def _restore_from_tensors(self, restored_tensors):
        if not tf.executing_eagerly():
            return tf.no_op()  # a SavedModel's traced restore: nothing to plan there
        record = json.loads(restored_tensors["plan"].numpy().decode())
        auto_planner = self._planner_ref()
        if auto_planner is not None and record.get("format") == _RECORD_FORMAT:
            auto_planner.restored(record)
        return None


class AutoPlanner:
    """The plan of one ``CompressedAllReduce`` under ``compressor="auto"``.

    ``ops`` gives the collectives (``gather_words``, ``time_all_reduce``), the cluster
    (``group_size``, ``local_devices``), the current ``generation`` and ``compressor``;
    ``new_generation()`` starts a new generation (new train functions).
    """

    def __init__(self, ops, new_generation):
        self._ops = ops
        self._new_generation = new_generation
        self._figures = None  # (generation, planner.Figures) once measured
        self._plan = None  # (generation, gradients, planner.Plan) once planned
        # The names of the gradients in a critical regime ("all": every one, until the
        # first interval ends), the last interval's norms and, by place among the
        # planned gradients, a sum of each one's reduced values over the interval
        # (None: regimes not tracked).
        self._critical = frozenset()
        self._norms = {}
        self._sums = None
        # A checkpoint's record, restored and not yet used by a plan.
        self._saved = None
        # How many times the figures were measured (a restored plan measures nothing).
        self.measurements = 0

    def reset(self):
        """Another compressor: the next plan starts afresh, no regimes tracked."""
        self._critical, self._norms, self._sums = frozenset(), {}, None

    @property
    def plan(self):
        """The current generation's plan, or None."""
        if self._plan is None or self._plan[0] != self._ops.generation:
            return None
        return self._plan[2]

    def row_compressor(self):
        """What embedding rows travel as under the current plan: the compressing
        candidate that carries most of the planned elements (the plan's view of the
        link, whose bytes the rows' varying count does not let it weigh itself), or
        None (the stock gather) when it sends everything as float32."""
        plan = self.plan
        if plan is None:
            return None
        elements = {}
        for e in plan.entries:
            if e.label != "fp32":
                elements[e.label] = elements.get(e.label, 0) + int(np.prod(e.shape))
        if not elements:
            return None
        # Ties go to the candidate with less error (max keeps the first).
        return max(planner.CANDIDATES, key=lambda c: elements.get(c.label, 0)).compressor

    # -- at trace time -----------------------------------------------------------------

    def plan_for(self, tensors, variables, mask, owner=None):
        """The plan of the gradients in ``mask``: made (measuring first, or from the
        figures a checkpoint of ``owner`` restored) at the first trace of a generation,
        then kept for the same gradients."""
        gradients = tuple((base.name_of(v), tuple(t.shape.as_list()), t.dtype.name)
                          for t, v, m in zip(tensors, variables, mask) if m)
        if self._plan is not None and self._plan[:2] == (self._ops.generation, gradients):
            return self._plan[2]
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is not None and len(self._ops.local_devices) > 1:
            # Replica threads take turns; the measurements run once, in the merge.
            replica_ctx.merge_call(lambda _: self._make(gradients, owner))
        else:
            self._make(gradients, owner)
        return self._plan[2]

    def _make(self, gradients, owner):
        generation = self._ops.generation
        if self._plan is not None and self._plan[:2] == (generation, gradients):
            return
        self._attach(owner)  # a deferred checkpoint restore reaches ``restored`` here
        auto = self._ops.compressor
        if self._figures is None or self._figures[0] != generation:
            figures = self._restored_figures(gradients)
            if figures is None:
                started = time.perf_counter()
                figures = planner.measure(self._ops, auto.link_gbps, auto.latency_ms)
                self.measurements += 1
                logging.info("tfgc: compressor='auto' measured in %.1f s: %s",
                             time.perf_counter() - started, figures.describe())
            self._figures = (generation, figures)
        plan = self._planned(gradients, self._figures[1])
        self._check_agree(plan)
        self._plan = (generation, gradients, plan)
        logging.info("%s", plan.table())

    # -- checkpoints -------------------------------------------------------------------

    def _attach(self, owner):
        """Tracks a ``PlanRecord`` on ``owner`` (once)."""
        if not isinstance(owner, trackable.Trackable):
            return
        owner._maybe_initialize_trackable()  # pylint: disable=protected-access
        existing = owner._lookup_dependency(RECORD_NAME)  # pylint: disable=protected-access
        if isinstance(existing, PlanRecord) and existing._planner_ref() is self:  # pylint: disable=protected-access
            return
        with tf.init_scope():
            owner._track_trackable(PlanRecord(self), name=RECORD_NAME, overwrite=True)  # pylint: disable=protected-access

    def snapshot(self) -> dict:
        """The current plan's inputs and key, as the checkpoint keeps them ({} before
        the first plan)."""
        plan = self.plan
        if plan is None:
            return {}
        figures = self._figures[1]
        critical = self._critical
        return {"format": _RECORD_FORMAT, "key": plan.key(),
                "gradients": json.loads(json.dumps(self._plan[1])),
                "num_workers": figures.num_workers,
                "candidates": [c.label for c in planner.CANDIDATES],
                "link_us": list(figures.link_us),
                "encode_us": {k: list(v) for k, v in figures.encode_us.items()},
                "decode_us": {k: list(v) for k, v in figures.decode_us.items()},
                "critical": critical if critical == "all" else sorted(critical),
                "norms": {str(k): v for k, v in self._norms.items()}}

    def restored(self, record: dict):
        """A checkpoint's record (``PlanRecord``): the next plan is made from it."""
        self._saved = record

    def _restored_figures(self, gradients):
        """The restored record's figures for these gradients, when every worker
        restored the same ones; else None (then all measure). Takes the record. Every
        worker calls it at the same point: it all-gathers a checksum."""
        record, self._saved = self._saved, None
        auto = self._ops.compressor
        usable = (record is not None
                  and json.loads(json.dumps(gradients)) == record["gradients"]
                  and record["num_workers"] == self._ops.group_size
                  and record["candidates"] == [c.label for c in planner.CANDIDATES]
                  and (auto.link_gbps or any(record["link_us"])
                       or self._ops.group_size < 2))
        word = 0
        if usable:
            figures_json = json.dumps({k: record[k] for k in
                                       ("link_us", "encode_us", "decode_us", "critical",
                                        "norms")}, sort_keys=True)
            word = zlib.crc32(figures_json.encode()) & 0x7FFFFFFF or 1
        words = self._ops.gather_words([word])[:, 0]
        if not usable or len(set(words.tolist())) > 1:
            if record is not None:
                logging.info("tfgc: compressor='auto': the checkpoint's plan is not for "
                             "these gradients, this cluster or every worker; measuring")
            return None
        figures = planner.Figures(
            record["num_workers"], tuple(record["link_us"]),
            {c.label: tuple(record["encode_us"][c.label]) for c in planner.CANDIDATES[1:]},
            {c.label: tuple(record["decode_us"][c.label]) for c in planner.CANDIDATES[1:]},
            auto.link_gbps, auto.latency_ms)
        if self._sums is not None:  # regimes tracked: carry on from the saved interval
            critical = record["critical"]
            self._critical = critical if critical == "all" else frozenset(critical)
            self._norms = {int(k): v for k, v in record["norms"].items()}
        logging.info("tfgc: compressor='auto': the plan's figures restored from the "
                     "checkpoint (%s)", figures.describe())
        return figures

    def _planned(self, gradients, figures):
        critical = self._critical
        if critical == "all":
            critical = frozenset(name for name, _, _ in gradients)
        return planner.make_plan(gradients, figures, self._ops.compressor.error,
                                 critical=critical)

    def _check_agree(self, plan):
        """Stops with a message if any worker derived another plan (a bug, or workers
        that build different models)."""
        digests = self._ops.gather_words([plan.digest()])[:, 0]
        if len(set(digests.tolist())) > 1:
            raise ValueError(
                "tfgc: the workers' compressor='auto' plans differ (digest by replica: "
                f"{digests.tolist()}); every worker must build the same model. This "
                f"worker's plan:\n{plan.table()}")


    def track(self, tensors, mask, reduced, replica_id):
        """Adds this step's reduced planned gradients to their interval sums (replica 0;
        non-finite values, a step skipped, are left out). In the traced step."""
        if self._sums is None or replica_id != 0:
            return
        planned = [(t, r) for t, m, r in zip(tensors, mask, reduced) if m]
        for j, (t, r) in enumerate(planned):
            if j not in self._sums:
                with tf.init_scope(), tf.device(self._ops.local_devices[0]):
                    self._sums[j] = state_lib.local_variable(tf.zeros(t.shape, t.dtype),
                                                             "tfgc_interval_sum")
            self._sums[j].assign_add(tf.where(tf.math.is_finite(r), r, tf.zeros_like(r)))

    # -- between steps -----------------------------------------------------------------

    def _adopt(self, gradients, figures, plan):
        """``plan`` from the next step on: a new generation (new train functions), which
        finds the plan and the figures ready."""
        self._new_generation()
        generation = self._ops.generation
        self._figures = (generation, figures)
        self._plan = (generation, gradients, plan)
        logging.info("%s", plan.table())

    def replan(self, margin: float) -> bool:
        """See ``CompressedAllReduce.replan``."""
        check_number("margin", margin, 0)
        current = self.plan
        if current is None:
            return False
        gradients, old = self._plan[1], self._figures[1]
        new = planner.measure_link(self._ops, old)
        if not planner.link_changed(old, new, current, margin):
            return False
        logging.info("tfgc: compressor='auto': the link changed (%s, was %s)",
                     new.describe(), old.describe())
        plan = self._planned(gradients, new)
        if plan.key() == current.key():
            self._figures = (self._figures[0], new)
            self._plan = (self._plan[0], gradients, plan)
            return False
        self._adopt(gradients, new, plan)
        return True

    def track_regimes(self):
        """See ``CompressedAllReduce.track_regimes``."""
        if self._sums is not None:
            return
        self._sums, self._critical, self._norms = {}, "all", {}
        if self.plan is not None:
            gradients, figures = self._plan[1], self._figures[1]
            self._adopt(gradients, figures, self._planned(gradients, figures))

    def adapt(self, threshold: float) -> frozenset:
        """See ``CompressedAllReduce.adapt``."""
        check_number("threshold", threshold, 0, strict=True)
        current = self.plan
        if self._sums is None or current is None:
            raise ValueError("adapt() needs track_regimes() and a step under "
                             "compressor='auto' first")
        gradients = self._plan[1]
        with tf.init_scope():
            norms = [float(tf.norm(self._sums[j])) if j in self._sums else float("nan")
                     for j in range(len(gradients))]
            for total in self._sums.values():
                total.assign(tf.zeros_like(total))
        # Worker 0's norms (as the bits of float32 words), so every worker decides alike.
        bits = np.asarray(norms, np.float32).view(np.int32)
        first = self._ops.gather_words(bits)[0].astype(np.int32).view(np.float32)
        now = {j: float(v) for j, v in enumerate(first)}
        critical = frozenset(gradients[j][0] for j in
                             planner.critical_layers(self._norms, now, threshold))
        self._norms = now
        changed = critical != self._critical
        self._critical = critical
        if changed:
            plan = self._planned(gradients, self._figures[1])
            if plan.key() != current.key():
                self._adopt(gradients, self._figures[1], plan)
            else:
                self._plan = (self._plan[0], gradients, plan)
        return critical

    @property
    def norms(self):
        """The last interval's norms, by place among the planned gradients."""
        return dict(self._norms)

    @property
    def figures(self):
        """The current figures (``planner.Figures``), or None before the first plan."""
        return None if self._figures is None else self._figures[1]
