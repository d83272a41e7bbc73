"""``compressor="auto"`` in a running strategy: its plan measured, made, checked, kept
and adapted (``AutoPlanner``); what a plan is and how it is chosen is ``planner``.

The cross-device ops hold one ``AutoPlanner`` and ask it for the plan of each traced
gradient reduction (``plan_for``). Each layout of gradients (a model's; a GAN's two
optimizers reduce two every step) has a plan, regimes and timed steps of its own
(``_Layout``), on figures they share. A plan belongs to the ops' *generation* (it goes
up with every change of setting, and each change retraces the train functions):
the first trace of a generation measures (every worker at once: the figures need
collectives) and plans, later traces of the same gradients reuse the plan. Between
steps, ``replan`` (the link measured again) and ``adapt`` (the end of an interval of
training: ACCORDION's critical regimes, and the low-rank errors measured again) and
``measure_low_rank`` (the first of those measurements, after the first step) may make
new plans, which ``_take`` hands to the next step by starting a new generation with
every layout's plan and the figures ready, so that trace measures nothing.

Checkpoints: the owner of the compression state (the optimizer) also tracks a
``PlanRecord``, which saves what the plan was made from (the gradients, the agreed
figures, the critical set, the last norms and low-rank errors, the steps timed under
each plan) and the plan itself: the figures once, and a part per layout planned
(a GAN's two). Restored before the first step
(Keras' ``BackupAndRestore``, a ``tf.train.Checkpoint`` restored into a new optimizer), it
reaches the planner when the record is attached, just before the first plan, and that
plan is the saved one, priced under the saved figures, instead of measuring again (or,
where the restored regimes and budgets rule it out, a plan made from them); the other
layouts' parts wait for their first plans, which take them under the restored figures
(a record with no part for the first layout planned is not used). The link
alone is measured again first (``planner.measure_link``, a fraction of a second): a
checkpoint restored on another network, where a float32 all-reduce of the planned
gradients takes ``RESTORED_LINK_FACTOR`` times as long or as short, is planned afresh
for that network, from the restored CPU timings, regimes and low-rank errors but none
of the steps timed on the old one; so is one restored under a given link
(``auto:link_gbps=``) other than the one its plan was made for. Its
embedding tables go as the saved plan sent them from the first trace on (dense or as
rows, priced with the rows it counted: ``dense_tables``). The workers
first agree that they all restored the same record (an all-gather of their checksums);
otherwise they all measure.
"""

import collections
import itertools
import json
import math
import re
import time
import weakref
import zlib

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.trackable import base as trackable

from tfgc.compressors.base import check_number, check_positive_float
from tfgc.distribute import embeddings, planner
from tfgc.distribute import state as state_lib
from tfgc.distribute.paths import base

# The record's name among the owner's checkpoint dependencies.
RECORD_NAME = "tfgc_auto_plan"
# 2: the figures once and a part per layout (``layouts``); 1 (read too): one layout,
# its part beside the figures.
_RECORD_FORMAT = 2
_LAYOUT_FIELDS = ("key", "labels", "gradients", "critical", "norms", "steps", "tables")
# A restored plan is kept unless the link measured at the restore predicts a float32
# all-reduce of its gradients this many times slower or faster than the saved figures
# did. Link classes differ by 10x (100 Mbit/s, 1, 10 Gbit/s); the probe of one link
# moved by up to 2.2x on a loaded 2-core host (the hop at 1.5 and 3.3 ms), which must
# not undo a restored plan (AutoPlanCallback's ``link_margin`` re-plans later, on
# its own interval).
RESTORED_LINK_FACTOR = 3.0
# The layouts of gradients kept at most (``_Layout``: a GAN's two models, models fitted
# in turn, a model's trainable sets as layers are frozen and thawed); beyond that the
# least recently traced is forgotten, with the interval sums worker 0 keeps for it,
# unless the train function being traced reduces it too (a step of more sets keeps
# them all).
MAX_LAYOUTS = 4
# A plan's timed step weighs (``_Layout.steps``: the pace's line and the plans gone
# back to) at the end of the interval it was timed in and of this many intervals
# after it (an interval: one whose steps were timed at its end, ``AutoPlanner._timed``);
# then it is forgotten, so a plan that once ran slow may be tried again where the
# planner predicts it faster, and a line drawn through steps of long ago (another data
# pipeline, another load on the hosts) does not price plans today. A plan running now
# is timed again at every interval's end.
TIMED_INTERVALS_KEPT = 8


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
        if auto_planner is not None and record.get("format") in (1, _RECORD_FORMAT):
            auto_planner.restored(record)
        return None


class _Layout:
    """One layout of planned gradients (``plan_for``'s: a model's, or the trainable part
    of one) and what the planner keeps by place in it: its plan, its regimes, the
    matrices kept for the low-rank measurement, the steps timed under its plans and its
    embedding tables' counted rows. A GAN's two optimizers reduce two layouts every
    step; models fitted in turn, or layers frozen and thawed, alternate between them."""

    def __init__(self, gradients, number, tracked):
        self.gradients = gradients
        self.number = number  # what the traced steps write to say this layout ran
        self.graph = None  # a weak reference to the graph that traced it last
        self.plan = None  # (generation, planner.Plan) once planned
        # The names of the gradients in a critical regime ("all": every one, until the
        # first interval ends), the last interval's norms by place ((mean, noise,
        # level): ``planner.interval_norm``) and, by place, a sum of each planned
        # gradient's reduced values over the interval and of their squared norms
        # (None: regimes not tracked), the steps the interval summed (worker 0's, with
        # the sums), and the steps that reached it, those skipped for a non-finite
        # gradient included.
        self.critical, self.norms, self.sums, self.summed = frozenset(), {}, None, None
        self.squares, self.reached = {}, None
        # The learning rate at the last interval's end (worker 0's; None: unknown),
        # which ``planner.learning_rate_fell`` compares the next one with; and after a
        # fall, by name, the label each gradient went as in the plan that ran, which
        # the next plans may not be lossier than (``planner.make_plan``'s ``held``).
        self.learning_rate, self.held = None, {}
        if tracked:
            self.start_regimes()
        # With regimes tracked and low-rank candidates on: by place, each matrix's last
        # kept local gradient (worker 0's only; a table sent as rows, densified); the
        # places of the planned gradients and of the tables sent as rows that are
        # matrices (every worker).
        self.last = {}
        self.matrices, self.row_matrices = [], []
        # The plans that ran, by key: (the predicted communication of the step, its
        # own and that of the other layouts that ran beside it, worker 0's measured
        # median step, its standard error), seconds (``planner.pace_from``); and the
        # other layouts' part of it when last timed, which its plans' pace holds as
        # compute (``planner.Pace.beside``).
        self.steps = {}
        self.others_s = 0.0
        # By key of ``steps``: the plans of the other layouts that trained in the same
        # steps when it was timed (their keys, sorted; "" alone), whose runs its step
        # holds too; and the interval (``AutoPlanner.intervals``) it was timed at.
        self.beside = {}
        self.timed_at = {}
        # The planner's choice when it last planned again (``_plan_again``).
        self.proposed = None
        # By place among the embedding tables: this worker's rows of the last step (a
        # local int32 variable: distinct rows, rows with repeats; zeros: not counted),
        # and every worker's most as last gathered (``AutoPlanner._count_rows``).
        self.counts, self.rows = {}, {}

    def matrix_places(self):
        """The places of its matrices that the low-rank candidates may take: the
        planned gradients', then the tables' sent as rows not among them."""
        return list(self.matrices) + [k for k in self.row_matrices if k not in self.matrices]

    def start_regimes(self):
        """No interval summed yet: every gradient critical until two intervals compare."""
        self.sums, self.squares, self.critical, self.norms = {}, {}, "all", {}
        self.learning_rate, self.held = None, {}

    def current(self, generation):
        """Its plan in ``generation``, or None."""
        return self.plan[1] if self.plan is not None and self.plan[0] == generation else None

    def summed_steps(self) -> float:
        """The steps its interval sums hold (worker 0's; 0 elsewhere). Eager."""
        return 0.0 if self.summed is None else float(self.summed.numpy())

    def reached_steps(self) -> float:
        """The interval's steps that reduced it, skipped ones included (worker 0's; 0
        elsewhere). Eager."""
        return 0.0 if self.reached is None else float(self.reached.numpy())

    def restart_counts(self):
        """The interval's step counts back to 0. Eager."""
        for count in (self.summed, self.reached):
            if count is not None:
                count.assign(0)


class AutoPlanner:
    """The plans of one ``CompressedAllReduce`` under ``compressor="auto"``: one per
    layout of gradients it reduces (``_Layout``), on figures they share.

    ``ops`` gives the collectives (``gather_words``, ``time_all_reduce``), the cluster
    (``group_size``, ``local_devices``), the current ``generation`` and ``compressor``;
    ``new_generation()`` starts a new generation (new train functions).
    """

    def __init__(self, ops, new_generation):
        self._ops = ops
        self._new_generation = new_generation
        self._figures = None  # (generation, planner.Figures) once measured
        # A checkpoint's record, restored and not yet used by a plan; and, for the
        # generation's first trace, the places among the tables that its plan sent dense
        # (generation, traced tables, places: ``dense_tables``).
        self._saved = None
        self._saved_dense = None
        # Which layout's planned reduction ran last on this worker (its number; a local
        # int32 variable, made at the first trace): the one ``plan`` shows.
        self._ran = None
        self._numbers = itertools.count()
        # How many times the figures were measured (a restored plan measures only the
        # link), how many restored plans the link measured then (or a given link other
        # than the plan's: ``_moved_link``) made afresh, and how
        # many times the plans went back to plans that ran faster (``_decide``).
        self.measurements = 0
        # Their seconds in all: they run inside the trace of a plan's first step, which
        # ``AutoPlanCallback`` takes, less them, for what a retrace costs until a change
        # of plan has been timed.
        self.measuring_s = 0.0
        self.relinked = 0
        self.went_back = 0
        # The intervals whose steps were timed (``_timed``), this worker's count: a
        # timed step's age (``TIMED_INTERVALS_KEPT``). The first low-rank measurement
        # times the first plan's steps too, so under ``AutoPlanCallback`` it reads one
        # more than the intervals ended (``AutoPlanCallback.history`` counts those).
        self.intervals = 0
        # ``intervals`` when the restored record was taken: the ages of its steps count
        # back from it, for every layout's part however late it is planned.
        self._record_intervals = 0
        self.reset()

    def reset(self):
        """Another compressor: the next plan starts afresh, no regimes tracked."""
        # By layout, least recently traced first.
        self._layouts = collections.OrderedDict()
        self._tracked = False
        # Worker 0's last low-rank measurement by gradient name (``planner.LowRank.errors``),
        # of every layout; and whether the next step keeps the matrices it measures
        # (``capture``; worker 0's: a copy of the matrices every step would cost the step
        # a pass over them).
        self._low_rank, self._capture = {}, None
        # The restored record's parts of the layouts not planned yet, by their
        # gradients (``_layout_key``): each takes its part when first planned.
        self._saved_layouts = {}
        # The given link the restored record's plan was made for (``link_gbps``,
        # ``latency_ms``; 0 Gbit/s: measured, None: not recorded).
        self._restored_link = (None, None)
        # A plan set by hand (``pin``): one label for every gradient, or labels by
        # gradient name (the others float32); None: the planner's own.
        self._pin = None
        # Why the low-rank and top-k candidates were left untimed (``_measured``: the
        # line logged the first time), or None once they are timed.
        self.untimed = None

    def _active(self):
        """The layouts whose plans belong to the current generation (planned in it, or
        carried into it by ``_take``), the least recently traced first (the same order
        on every worker: each traces its steps at the same points)."""
        generation = self._ops.generation
        return [lay for lay in self._layouts.values() if lay.current(generation) is not None]

    def _shown(self):
        """The layout whose reduction ran last (the last planned before any ran)."""
        if not self._layouts:
            return None
        if self._ran is not None:
            with tf.init_scope():
                number = int(self._ran.numpy())
            for lay in self._layouts.values():
                if lay.number == number:
                    return lay
        return next(reversed(self._layouts.values()))

    @property
    def plan(self):
        """The current generation's plan of the gradients reduced last, or None."""
        lay = self._shown()
        return None if lay is None else lay.current(self._ops.generation)

    def _first_planned(self):
        """``_active``'s layouts in the order first planned."""
        return sorted(self._active(), key=lambda lay: lay.number)

    @property
    def plans(self):
        """The current generation's plan of each layout, in the order first planned."""
        return [lay.plan[1] for lay in self._first_planned()]

    @staticmethod
    def row_compressor(plan):
        """What the embedding rows travel as under ``plan`` (its tables' label,
        ``planner.row_candidate``), or None: the stock gather."""
        if plan.tables:
            candidate = planner.BY_LABEL[plan.tables[0].label]
        else:
            candidate = planner.row_candidate(plan.entries, plan.error_budget,
                                              plan.num_workers)
        return None if candidate is None else candidate.compressor

    def dense_tables(self, variables, owner=None) -> frozenset:
        """The places among the embedding tables ``variables`` (traced, in the gradients'
        order) that the current generation's plan of those tables sends as dense
        gradients; none where no plan of this generation has them (another model).
        Before the generation's first plan: the places a restored checkpoint's plan
        sent dense (``_restored_dense``; ``owner``: the state's owner, which a deferred
        restore reaches), so that its first step sends the tables as the saved plan
        did."""
        active = self._active()
        if not active:
            return self._restored_dense(variables, owner) if variables else frozenset()
        traced = _traced(variables)
        for lay in active:
            plan = lay.plan[1]
            if plan.tables and [(t.name, t.shape) for t in plan.tables] == traced:
                return plan.dense_places
        saved = _saved_tables_of(self._saved_layouts.values(), traced)
        return frozenset() if saved is None else _dense_places(saved)  # planned later

    def _restored_dense(self, variables, owner) -> frozenset:
        """The places the restored record's plan sent dense, where its tables are the
        traced ``variables`` and every worker restored the same ones; else none. Every
        worker calls it at the same point (the first trace of a generation with
        tables): it all-gathers a checksum, once a generation."""
        traced = _traced(variables)
        generation = self._ops.generation
        if self._saved_dense is not None and self._saved_dense[:2] == (generation, traced):
            return self._saved_dense[2]

        def agree(*_):
            self._attach(owner)  # a deferred checkpoint restore reaches ``restored`` here
            saved = _saved_tables_of((self._saved or {}).get("layouts") or [], traced)
            places = frozenset()
            if self._all_restored(json.dumps(saved) if saved is not None else None):
                places = _dense_places(saved)
            self._saved_dense = (generation, traced, places)

        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is not None and len(self._ops.local_devices) > 1:
            replica_ctx.merge_call(agree)  # the replicas' threads gather once
        else:
            agree()
        return self._saved_dense[2]

    # -- at trace time -----------------------------------------------------------------

    def plan_for(self, tensors, variables, mask, owner=None, positions=None, tables=()):
        """The plan of the gradients in ``mask`` and of the embedding ``tables``: made
        (measuring first, or from the figures a checkpoint of ``owner`` restored) at the
        first trace of a generation, then kept for the same gradients.

        ``tables``: (index among all the gradients, variable, dtype) of each table whose
        rows the plan may send (``embeddings.ROWS``), in order; those the trace summed
        into a dense gradient are among ``tensors`` too, whose indices among all the
        gradients are ``positions`` (default: 0, 1, ...)."""
        if positions is None:
            positions = range(len(tensors))
        where = {i: p for p, (i, _, _) in enumerate(tables)}
        items = [(i, (base.name_of(v), tuple(t.shape.as_list()), t.dtype.name))
                 for i, t, v, m in zip(positions, tensors, variables, mask)
                 if m and i not in where]
        items += [(i, (base.name_of(v), tuple(tf.TensorShape(v.shape).as_list()),
                       tf.as_dtype(dtype).name, "table")) for i, v, dtype in tables]
        layout = tuple(g for _, g in sorted(items, key=lambda item: item[0]))
        dense = frozenset(where[i] for i, m in zip(positions, mask) if m and i in where)
        graph = tf.compat.v1.get_default_graph()  # the train function being traced
        if not self._is_current(layout, dense):
            replica_ctx = tf.distribute.get_replica_context()
            if replica_ctx is not None and len(self._ops.local_devices) > 1:
                # Replica threads take turns; the measurements run once, in the merge.
                replica_ctx.merge_call(lambda _: self._make(layout, owner, dense, graph))
            else:
                self._make(layout, owner, dense, graph)
        lay = self._layouts[layout]
        lay.graph = weakref.ref(graph)
        self._layouts.move_to_end(layout)  # the most recently traced last
        return lay.plan[1]

    def _is_current(self, layout, dense) -> bool:
        lay = self._layouts.get(layout)
        plan = None if lay is None else lay.current(self._ops.generation)
        return plan is not None and plan.dense_places == dense

    def _make(self, gradients, owner, dense=frozenset(), graph=None):
        generation = self._ops.generation
        if self._is_current(gradients, dense):
            return
        self._attach(owner)  # a deferred checkpoint restore reaches ``restored`` here
        lay = self._layout(gradients, graph)
        self._count_rows(lay)
        auto = self._ops.compressor
        labels = rows_label = None
        if self._figures is not None and self._figures[0] == generation:
            # A record reaching the planner now (another optimizer's copy of the
            # checkpoint, attached at its first plan) comes after this generation's
            # figures: the one taken with them holds every layout's part already.
            self._saved = None
            part = self._saved_layouts.pop(_layout_key(gradients), None)
            if part is not None:  # restored with the figures this generation took
                labels, rows_label = self._take_part(lay, part, self._record_intervals)
        else:
            figures, labels, rows_label = self._restored_figures(lay)
            started = time.perf_counter()
            moved = figures is not None and self._moved_link(lay, figures)
            self.measuring_s += time.perf_counter() - started  # the link, probed again
            if moved:
                figures, labels, rows_label = moved, None, None
                for part in self._saved_layouts.values():
                    part["labels"], part["steps"] = None, []  # timed on the old link
            if figures is None:
                started = time.perf_counter()
                figures = planner.measure(self._ops, auto.link_gbps, auto.latency_ms)
                self.measurements += 1
                self.measuring_s += time.perf_counter() - started
                logging.info("tfgc: compressor='auto' measured in %.1f s: %s",
                             time.perf_counter() - started, figures.describe())
            self._figures = (generation, figures)
        if self._pin is not None:
            self._figures = (generation, self._pinned_figures(self._figures[1]))
        plan = None
        if labels is not None and self._pin is None:  # {}: a plan of tables alone
            # The saved plan itself, where the restored regimes and budgets still allow
            # it: a plan made afresh could differ (a change kept out because it did not
            # pay, steps timed after the plan was made).
            # Its tables' rows too, in what they went as then.
            plan = self._planned(lay, self._figures[1], only=labels, dense=dense,
                                 rows_label=rows_label)
        if plan is None:
            plan = self._planned(lay, self._figures[1], dense=dense)
        self._check_agree(plan)
        lay.plan = (generation, plan)
        logging.info("%s", plan.table())

    def _layout(self, gradients, graph=None):
        """The layout of ``gradients``, made the first time (each layout has regimes,
        sums and timed steps of its own; the low-rank errors, by gradient name, and the
        figures are shared; ``plan_for`` keeps them in the order traced). Beyond
        ``MAX_LAYOUTS``, the least recently traced of those that ``graph`` (the train
        function being traced) does not reduce is forgotten, and with it its sums
        (worker 0 keeps a gradient's size in them for each layout)."""
        lay = self._layouts.get(gradients)
        if lay is None:
            if self._layouts:
                logging.info("tfgc: compressor='auto': other gradients are planned (another "
                             "model, or other trainable variables): a plan of their own, "
                             "beside %d other%s", len(self._layouts),
                             "s" if len(self._layouts) > 1 else "")
            lay = _Layout(gradients, next(self._numbers), self._tracked)
            # Never one this trace reduces: a step that reduces more sets than the
            # bound keeps them all (they are parts of its gradients, so their sums add
            # up to the step's gradients at most).
            while len(self._layouts) >= MAX_LAYOUTS:
                stale = next((key for key, other in self._layouts.items()
                              if other.graph is None or other.graph() is not graph), None)
                if stale is None:
                    break
                del self._layouts[stale]
            self._layouts[gradients] = lay
        return lay

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
            state_lib.track(owner, RECORD_NAME, PlanRecord(self))

    def snapshot(self) -> dict:
        """The current plans' inputs and keys, as the checkpoint keeps them: the figures
        and low-rank errors once, and a part per layout planned in this generation,
        in the order first planned ({} before the first plan)."""
        active = self._first_planned()
        if not active:
            return {}
        figures = self._figures[1]
        return {"format": _RECORD_FORMAT,
                "num_workers": figures.num_workers,
                "candidates": [c.label for c in planner.ALL],
                "link_us": list(figures.link_us),
                # The link the plan was made for, where given (0: measured).
                "link_gbps": figures.link_gbps, "latency_ms": figures.latency_ms,
                "encode_us": {k: list(v) for k, v in figures.encode_us.items()},
                "decode_us": {k: list(v) for k, v in figures.decode_us.items()},
                "low_rank": {name: [sq, {str(r): e for r, e in rel.items()}]
                             for name, (sq, rel) in self._low_rank.items()},
                "layouts": [self._part(lay) for lay in active]}

    def _part(self, lay) -> dict:
        """``lay``'s part of the record: its plan, gradients, regimes and timed steps."""
        plan = lay.plan[1]
        critical = lay.critical
        return {"key": plan.key(),
                "labels": {e.name: e.label for e in plan.entries},
                # A plan set by hand: not restored as the planner's own choice.
                "pinned": self._pin is not None,
                "gradients": json.loads(json.dumps(lay.gradients)),
                "critical": critical if critical == "all" else sorted(critical),
                "norms": {str(k): list(v) for k, v in lay.norms.items()},
                "learning_rate": lay.learning_rate,
                "held": dict(sorted(lay.held.items())),
                # Each timed step: key, communication, step, its error, the plans
                # beside it, and how many intervals ago it was timed.
                "steps": [[key, comm, step, se if math.isfinite(se) else None,
                           lay.beside.get(key),
                           self.intervals - lay.timed_at.get(key, self.intervals)]
                          for key, (comm, step, se) in sorted(lay.steps.items())],
                "others_s": lay.others_s,
                # Each table: place, name, shape, sent dense, the rows it was priced
                # with, what its rows go as.
                "tables": [[t.place, t.name, list(t.shape), t.dense, t.rows, t.tokens,
                            t.label] for t in plan.tables]}

    def restored(self, record: dict):
        """A checkpoint's record (``PlanRecord``): the next plans are made from it."""
        if record.get("format") == 1:  # one layout, its part beside the figures
            record = dict({k: v for k, v in record.items() if k not in _LAYOUT_FIELDS},
                          layouts=[{k: record.get(k) for k in _LAYOUT_FIELDS}])
        self._saved = record

    def _restored_figures(self, lay):
        """The restored record's figures, where it has a part for the layout ``lay`` and
        every worker restored the same record, and that part's plan's labels by name and
        what its tables' rows went as; else (None, None, None) (then all measure). Takes
        the record; its parts of other layouts wait for their first plan
        (``_saved_layouts``). Every worker calls it at the same point: it all-gathers a
        checksum."""
        record, self._saved = self._saved, None
        auto = self._ops.compressor
        key = _layout_key(lay.gradients)
        parts = {_layout_key(part["gradients"]): part
                 for part in (record or {}).get("layouts") or []}
        usable = (key in parts
                  and record["num_workers"] == self._ops.group_size
                  and record["candidates"] == [c.label for c in planner.ALL]
                  and len(record["link_us"]) == len(planner.LINK_SIZES)
                  and (auto.link_gbps or any(record["link_us"])
                       or self._ops.group_size < 2))
        self._saved_layouts = {}
        if not self._all_restored(json.dumps(record, sort_keys=True) if usable else None):
            if record is not None:
                logging.info("tfgc: compressor='auto': the checkpoint's plan is not for "
                             "these gradients, this cluster or every worker; measuring")
            return None, None, None
        figures = planner.Figures(
            record["num_workers"], tuple(record["link_us"]),
            {label: tuple(us) for label, us in record["encode_us"].items()},
            {label: tuple(us) for label, us in record["decode_us"].items()},
            auto.link_gbps, auto.latency_ms)
        if self._tracked:
            self._low_rank = {name: (sq, {_error_key(k): e for k, e in rel.items()})
                              for name, (sq, rel) in record.get("low_rank", {}).items()}
        part = parts.pop(key)
        self._saved_layouts = parts
        self._restored_link = (record.get("link_gbps"), record.get("latency_ms"))
        logging.info("tfgc: compressor='auto': the plan's figures restored from the "
                     "checkpoint (%s)", figures.describe())
        self._record_intervals = self.intervals
        return (figures,) + self._take_part(lay, part, self.intervals)

    @staticmethod
    def _take_part(lay, part, intervals=0):
        """A restored ``part`` of the record into the layout ``lay`` (its regimes and
        timed steps, where regimes are tracked, and its tables' counted rows); returns
        its plan's labels by name and what its tables' rows went as (None, None for a
        plan that was pinned: ``pin``). ``intervals``: ``AutoPlanner.intervals`` now,
        which a timed step's age in the record counts back from."""
        if lay.sums is not None:  # regimes tracked: carry on from the saved interval
            critical = part["critical"]
            lay.critical = critical if critical == "all" else frozenset(critical)
            # (mean, noise, level) by place; a record before the noise was kept has the
            # interval sums' bare norms, not comparable: none (the next interval is
            # critical, as the first is).
            lay.norms = {int(k): tuple(float(x) for x in v)
                         for k, v in (part.get("norms") or {}).items()
                         if isinstance(v, list) and len(v) == 3
                         and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                 for x in v)}
            rate = part.get("learning_rate")  # records before it: unknown
            lay.learning_rate = float(rate) if isinstance(rate, (int, float)) \
                and not isinstance(rate, bool) else None
            lay.held = {str(k): v for k, v in (part.get("held") or {}).items()
                        if isinstance(v, str) and v in planner.BY_LABEL}
            lay.steps = steps_from_record(part.get("steps") or [])
            # Rows written before the plans beside were kept have none: unknown.
            lay.beside = {row[0]: row[4] for row in part.get("steps") or []
                          if len(row) > 4 and isinstance(row[4], str)}
            # Rows written before steps aged have none: timed now.
            lay.timed_at = {row[0]: intervals - (row[5] if len(row) > 5 and isinstance(
                row[5], int) and row[5] >= 0 else 0) for row in part.get("steps") or []}
            lay.others_s = float(part.get("others_s") or 0.0)  # format 2 before it: none
        tables = part.get("tables") or []
        for place, _, _, _, rows, tokens, _ in tables:
            if lay.rows.get(place, (0, 0))[0] == 0:  # not counted since: the saved count
                lay.rows[place] = (rows, tokens)
        if part.get("pinned"):  # planned afresh from the restored figures and regimes
            return None, None
        return part.get("labels"), tables[0][6] if tables else None

    def _moved_link(self, lay, figures):
        """The restored ``figures`` with the link measured now (every worker at once),
        where that predicts the float32 all-reduce of ``lay``'s gradients
        ``RESTORED_LINK_FACTOR`` times slower or faster than they do; then the steps
        timed on the old link are forgotten. Otherwise None. A link given now
        (``link_gbps``; ``figures`` hold it) is no measurement's noise: the plan is made
        afresh unless the checkpoint's was made for that same given link. Every worker
        calls it at the same point, after agreeing on the restored figures."""
        auto = self._ops.compressor
        if auto.link_gbps:
            if self._restored_link == (auto.link_gbps, auto.latency_ms) \
                    or figures.num_workers < 2:  # the same link, or none to plan for
                return None
            was, latency = self._restored_link
            logging.info("tfgc: compressor='auto': the given link (%g Gbit/s, %g ms) is "
                         "not the checkpoint's (%s): planning for it afresh",
                         auto.link_gbps, auto.latency_ms,
                         f"{was:g} Gbit/s, {latency:g} ms" if was else
                         "measured" if was is not None else "not recorded")
            new = figures
        else:
            new = planner.measure_link(self._ops, figures)
            if new is figures:  # one worker: nothing measured
                return None
            nbytes = sum((tf.TensorShape(g[1]).num_elements() or 0) * tf.as_dtype(g[2]).size
                         for g in lay.gradients)
            ratio = max(planner.link_ratio(figures, new, nbytes, figures.num_workers), 1e-12)
            if max(ratio, 1.0 / ratio) < RESTORED_LINK_FACTOR:
                return None
            logging.info("tfgc: compressor='auto': the link differs from the checkpoint's "
                         "(%s, was %s): planning for it afresh", new.describe_link(),
                         figures.describe_link())
        self.relinked += 1
        for other in self._layouts.values():
            other.steps, other.beside, other.timed_at = {}, {}, {}
        return new

    def _all_restored(self, text) -> bool:
        """Whether every worker restored ``text`` (this worker's, None where it has
        nothing usable): an all-gather of its checksum. Every worker calls it at the
        same point."""
        word = 0 if text is None else zlib.crc32(text.encode()) & 0x7FFFFFFF or 1
        words = self._ops.gather_words([word])[:, 0]
        return bool(word) and len(set(words.tolist())) == 1

    def _planned(self, lay, figures, only=None, dense=None, rows_label=None):
        """The plan of the layout ``lay`` under ``figures`` and its current regimes,
        the errors and its steps (``planner.plan_tables``): the tables at the places
        ``dense`` sent dense (their rows as ``rows_label``, where given), or, with None,
        the faster choice from the rows last counted (``_count_rows``, which the
        callers gather first). Under a pin (``pin``), the pinned plan instead, whatever
        ``only`` and ``rows_label`` say."""
        gradients = lay.gradients
        if self._pin is not None:
            only = {g[0]: self._pinned_label(g[0]) for g in gradients}
            # Tables go as rows (unless the trace summed them dense already), in the
            # pinned label where it is a quantizer (the first table's, for a pin by
            # name), else float32 on the stock gather: rows change from step to step,
            # with no residual or query of their own for low rank or top-k.
            dense = frozenset() if dense is None else dense
            names = [g[0] for g in gradients if len(g) > 3]
            if names:
                candidate = planner.BY_LABEL[self._pinned_label(names[0])]
                rows_label = (candidate.label if candidate.error_key is None
                              else "fp32")
        critical = lay.critical
        if critical == "all":
            critical = frozenset(g[0] for g in gradients)
        auto = self._ops.compressor
        low_rank = None
        if auto.budget_rank and self._low_rank:
            low_rank = planner.LowRank(auto.budget_rank, dict(self._low_rank),
                                       auto.critical_rank, auto.critical_error)
        pace = planner.pace_from(self._points(lay), auto.low_rank_steps)
        if pace is not None:
            pace = pace.beside(lay.others_s)
        tables = {k: lay.rows.get(p, (0, 0))
                  for p, k in enumerate(_table_places(gradients))}
        return planner.plan_tables([tuple(g[:3]) for g in gradients], tables, figures,
                                   auto.error, dense=dense, rows_label=rows_label,
                                   critical=critical, low_rank=low_rank, only=only, pace=pace,
                                   forced=self._pin is not None, held=lay.held)

    def _points(self, lay):
        """The whole steps ``lay`` ran in that were timed (``planner.pace_from``'s
        points): its own ``steps``, and the steps the other layouts timed beside one of
        its plans. A key keeps only its last step, so where the other layouts changed
        plan beside an unchanged plan of ``lay``, theirs hold the steps it ran in
        before."""
        points = {_point_key(p): p for p in lay.steps.values()}
        mine = set(lay.steps)
        for other in self._layouts.values():
            if other is lay:
                continue
            for key, point in other.steps.items():
                if mine.intersection(_BESIDE_SPLIT.split(other.beside.get(key) or "")):
                    points.setdefault(_point_key(point), point)
        return list(points.values())

    def _count_rows(self, lay):
        """Every worker's rows of ``lay``'s last step, the most of each (``rows``). Every
        worker calls it at the same point."""
        places = range(len(_table_places(lay.gradients)))
        if not places or any(p not in lay.counts for p in places):
            return  # no step counted them yet (the same on every worker)
        with tf.init_scope():
            words = np.concatenate([lay.counts[p].numpy() for p in places])
        most = np.max(self._ops.gather_words(words.tolist()), axis=0)
        lay.rows = {p: (int(most[2 * p]), int(most[2 * p + 1])) for p in places}

    def _first_floats(self, values, most=0):
        """Worker 0's ``values`` (float32, sent as the bits of words), on every worker;
        the last ``most`` of them the most of every worker's instead (NaN where any
        worker's is)."""
        bits = np.asarray(values, np.float32).view(np.int32)
        rows = np.asarray(self._ops.gather_words(bits)).astype(np.int32).view(np.float32)
        first = np.array(rows[0])
        if most:
            first[-most:] = np.max(rows[:, -most:], axis=0)
        return first

    def _repriced(self, lay, current):
        """``current`` priced with the rows the last step counted, where it has tables
        (the first plan's are not counted yet, so it priced their rows at nothing): the
        communication its timed steps are set against. Every worker calls it at the same
        point."""
        if not current.tables:
            return current
        self._count_rows(lay)
        plan = self._as_running(lay, self._figures[1], current)
        return current if plan is None or plan.key() != current.key() else plan

    def _as_running(self, lay, figures, current):
        """``current``'s choice priced anew under ``figures`` and the current regimes
        and budgets, its tables as its traced step sends them (None where they rule
        that choice out)."""
        return self._planned(lay, figures,
                             only={e.name: e.label for e in current.entries},
                             dense=current.dense_places,
                             rows_label=current.tables[0].label if current.tables else None)

    def _timed(self, ran, step_s, step_se_s):
        """Keeps worker 0's measured step and its standard error (from its words, NaN:
        none; an error not given stays NaN, which ``planner.pace_from`` reads as
        unknown) for the current plan of each layout in ``ran`` (those that trained in
        the steps measured), with the communication the step's plans predict: a step
        that reduces several layouts (a GAN) spends the communication of all, so each
        layout's pace is the line through whole steps against all of it, and it keeps
        the others' part as compute. It counts their tables' rows (``_repriced``),
        which the plans made next read. Every worker calls it at the same point."""
        predicted = {lay: self._repriced(lay, lay.plan[1]).step_seconds() for lay in ran}
        if not ran or not (math.isfinite(step_s) and step_s > 0):
            return
        total = sum(predicted.values())
        self.intervals += 1
        for lay in ran:
            lay.others_s = total - predicted[lay]
            lay.steps[lay.plan[1].key()] = (total, step_s, step_se_s)
            lay.beside[lay.plan[1].key()] = self._beside(lay, ran)
            lay.timed_at[lay.plan[1].key()] = self.intervals
        for lay in self._layouts.values():
            self._forget_old(lay)

    def _forget_old(self, lay):
        """``lay``'s steps timed more than ``TIMED_INTERVALS_KEPT`` intervals ago
        forgotten."""
        for key in [k for k in lay.steps
                    if self.intervals - lay.timed_at.get(k, self.intervals)
                    > TIMED_INTERVALS_KEPT]:
            del lay.steps[key]
            lay.beside.pop(key, None)
            lay.timed_at.pop(key, None)

    def _check_agree(self, plan):
        """Stops with a message if any worker derived another plan (a bug, or workers
        that build different models)."""
        digests = self._ops.gather_words([plan.digest()])[:, 0]
        if len(set(digests.tolist())) > 1:
            raise ValueError(
                "tfgc: the workers' compressor='auto' plans differ (digest by replica: "
                f"{digests.tolist()}); every worker must build the same model. This "
                f"worker's plan:\n{plan.table()}")

    def _layout_of(self, plan):
        """The layout whose plan ``plan`` is (the traced step's), or None."""
        for lay in self._layouts.values():
            if lay.plan is not None and lay.plan[1] is plan:
                return lay
        return None

    def track(self, plan, tensors, variables, mask, reduced, replica_id, ok=None):
        """For the reduction ``plan_for`` planned as ``plan``: notes that its layout ran
        (``plan``), and on worker 0 (whose figures every worker takes, ``adapt``) adds
        this step's reduced planned gradients to their interval sums, unless the step
        was skipped (``ok`` False: not finite somewhere), and, with low-rank candidates
        on and a capture asked for, keeps each matrix's local gradient for the next
        measurement. Every worker notes which gradients are matrices. In the traced
        step, replica 0.

        The other workers keep nothing: on a cluster of few cores the sums alone cost
        the step about a fifth (the wide MLP, 4 workers on 2 cores: 114 against 147 ms).
        """
        lay = self._layout_of(plan)
        if lay is None or replica_id != 0:
            return
        with tf.init_scope(), tf.device(self._ops.local_devices[0]):
            if self._ran is None:
                self._ran = state_lib.local_variable(tf.constant(-1), "tfgc_planned_layout")
        self._ran.assign(lay.number)
        if lay.sums is None:
            return
        # By place in the layout.
        planned = dict(zip(_planned_places(lay.gradients, plan), [
            (t, v, r) for t, v, m, r in zip(tensors, variables, mask, reduced) if m]))
        if self._ops.compressor.budget_rank > 0:
            lay.matrices = [j for j, (t, _, _) in planned.items()
                            if planner.LOW_RANK[0].described.supports(t.shape, t.dtype)]
        if self._ops.worker_rank != 0:
            return
        with tf.init_scope(), tf.device(self._ops.local_devices[0]):
            self._make_sums(lay, [(j, t.shape, t.dtype) for j, (t, _, _) in planned.items()])
            for j in lay.matrices:
                if j not in lay.last:
                    lay.last[j] = state_lib.local_variable(
                        tf.zeros(planned[j][0].shape, planned[j][0].dtype),
                        "tfgc_last_gradient")
            if lay.matrices and self._capture is None:
                self._capture = state_lib.local_variable(tf.constant(True), "tfgc_capture")
        if ok is None:  # nothing compressed: no step decision, so look at the values
            ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(r))
                                for _, _, r in planned.values()] or [True])

        def add():
            for j, (_, _, r) in planned.items():
                lay.sums[j].assign_add(r)
                # l2_loss: one fused pass (the wide MLP's 6M entries in one process,
                # median of 15 x 50 calls: 0.9 ms on top of the sums' 3.1 ms, where a
                # square and a sum took 2.5).
                lay.squares[j].assign_add(2.0 * tf.nn.l2_loss(tf.cast(r, tf.float32)))
            lay.summed.assign_add(1)
            return tf.constant(True)

        tf.cond(ok, add, lambda: tf.constant(False))
        lay.reached.assign_add(1)
        if lay.matrices:
            def keep():
                for j in lay.matrices:
                    lay.last[j].assign(planned[j][0])
                return tf.constant(True)

            tf.cond(self._capture.read_value(), keep, lambda: tf.constant(False))

    @staticmethod
    def _make_sums(lay, places):
        """Worker 0's interval sums of ``lay`` at ``places`` ((place, shape, dtype)) and
        of their squared norms, and its count of summed steps, where not made yet. In
        ``tf.init_scope``."""
        for j, shape, dtype in places:
            if j not in lay.sums:
                lay.sums[j] = state_lib.local_variable(tf.zeros(shape, dtype),
                                                       "tfgc_interval_sum")
                lay.squares[j] = state_lib.local_variable(tf.constant(0.0),
                                                          "tfgc_interval_squares")
        if lay.summed is None:
            lay.summed = state_lib.local_variable(tf.constant(0), "tfgc_interval_steps")
            lay.reached = state_lib.local_variable(tf.constant(0), "tfgc_interval_reached")

    def track_tables(self, plan, slices, variables, reduced, ok, replica_id):
        """Each embedding table's rows this step (``slices``, IndexedSlices, by place
        among the tables; ``reduced``: the summed rows of those ``plan`` does not send
        dense, None for the others; ``ok``: the step's decision, or None). Counted on
        every worker (``_count_rows``); on worker 0, with regimes tracked, the summed
        rows added to the table's interval sum (a table has its regime as rows too, so
        a switch to dense finds its previous norm), and, with low-rank candidates on,
        the local rows kept densified when a capture is asked for, so that the low-rank
        measurement prices the table dense too. In the traced step, replica 0."""
        lay = self._layout_of(plan)
        if replica_id != 0 or lay is None:
            return
        with tf.init_scope(), tf.device(self._ops.local_devices[0]):
            for p in range(len(slices)):
                if p not in lay.counts:
                    lay.counts[p] = state_lib.local_variable(tf.zeros([2], tf.int32),
                                                             "tfgc_table_rows")
        for p, s in enumerate(slices):
            unique, _ = tf.unique(tf.reshape(s.indices, [-1]))
            lay.counts[p].assign(tf.stack([tf.size(unique, tf.int32),
                                           tf.size(s.indices, tf.int32)]))
        if lay.sums is None:
            return
        places = _table_places(lay.gradients)
        rows = [(places[p], s, v, r)
                for p, (s, v, r) in enumerate(zip(slices, variables, reduced)) if r is not None]
        low_rank = planner.LOW_RANK[0].described
        captured = [(k, s, v) for k, s, v, _ in rows if self._ops.compressor.budget_rank > 0
                    and low_rank.supports(tf.TensorShape(v.shape), s.values.dtype)]
        lay.row_matrices = [k for k, _, _ in captured]
        if self._ops.worker_rank != 0 or not rows:
            return
        with tf.init_scope(), tf.device(self._ops.local_devices[0]):
            self._make_sums(lay, [(k, v.shape, s.values.dtype) for k, s, v, _ in rows])
            for k, s, v in captured:
                if k not in lay.last:
                    lay.last[k] = state_lib.local_variable(
                        tf.zeros(v.shape, s.values.dtype), "tfgc_last_gradient")
            if captured and self._capture is None:
                self._capture = state_lib.local_variable(tf.constant(True), "tfgc_capture")
        if ok is None:
            ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(r.values))
                                for _, _, _, r in rows])

        def add():
            for k, _, v, r in rows:
                values = tf.reshape(r.values, [-1] + tf.TensorShape(v.shape)[1:].as_list())
                lay.sums[k].scatter_add(tf.IndexedSlices(values, r.indices))
                # The step's squared norm: rows that repeat summed first.
                unique, where = tf.unique(tf.reshape(r.indices, [-1]))
                rows_sum = tf.math.unsorted_segment_sum(values, where, tf.size(unique))
                lay.squares[k].assign_add(2.0 * tf.nn.l2_loss(tf.cast(rows_sum, tf.float32)))
            return tf.constant(True)

        tf.cond(ok, add, lambda: tf.constant(False))
        if captured:
            def keep():
                for k, s, v in captured:
                    lay.last[k].assign(embeddings.densify(s, v))
                return tf.constant(True)

            tf.cond(self._capture.read_value(), keep, lambda: tf.constant(False))

    def capture(self):
        """See ``CompressedAllReduce.capture_gradients``."""
        if self._capture is not None:
            self._capture.assign(True)

    def _measure_low_rank(self, lay):
        """Worker 0's measured errors of every matrix ``lay`` kept
        (``planner.low_rank_errors`` and ``planner.top_k_errors`` of its last local
        gradient), agreed: every worker gets the same numbers. Eager; every worker
        calls it at the same point.

        The gradient alone, not with the error-feedback residual of the candidate it
        goes as now: what a candidate loses on its input depends on that residual
        (top-k's spreads a step's energy over many entries, PowerSGD's over many
        directions), so errors measured with it made the candidate that ran look worse
        than those that did not, and the plan swapped them (MobileNetV2 on
        Fashion-MNIST: top-k on 10-14 gradients and PowerSGD on 5 in turn, six times in
        11 intervals). On the gradient alone every candidate is measured on the same
        input whatever ran, as the budget's reference is. (The gradient kept is the one
        the step sends: on the first step after a plan moved a gradient off error
        feedback, it holds the residual carried over.)"""
        places = lay.matrix_places()
        if not places:
            return {}
        keys = list(planner.RANKS) + [c.label for c in planner.SPARSE]
        width = 1 + len(keys)
        values = np.zeros([len(places), width], np.float32)
        if self._ops.worker_rank == 0:
            for row, j in enumerate(places):
                measured = planner.measured_errors(lay.last[j].numpy(), seed=j)
                if measured:  # else (a step that was not finite) left out, as zeros are
                    values[row] = [measured[0]] + [measured[1][key] for key in keys]
        bits = values.reshape(-1).view(np.int32)
        agreed = self._ops.gather_words(bits)[0].astype(np.int32).view(np.float32)
        agreed = agreed.reshape(len(places), width)
        # A matrix without a squared norm was not measured (not finite): no low rank.
        return {lay.gradients[j][0]: (float(agreed[row, 0]),
                                      {key: float(agreed[row, 1 + k])
                                       for k, key in enumerate(keys)})
                for row, j in enumerate(places) if agreed[row, 0] > 0}

    # -- between steps -----------------------------------------------------------------

    def _take(self, plans, figures, retrace=False) -> bool:
        """``plans`` ({layout: plan}, of layouts planned in the current generation) and
        ``figures`` from the next step on. Where a plan differs from its layout's (or
        ``retrace``), a new generation (new train functions) finds these plans and the
        figures ready (the layouts left out are planned again when traced); otherwise
        they replace the current ones (priced anew) in this generation. Returns
        whether a new generation started."""
        changed = [lay for lay, plan in plans.items() if plan.key() != lay.plan[1].key()]
        if changed or retrace:
            self._new_generation()
        generation = self._ops.generation
        self._figures = (generation, figures)
        for lay, plan in plans.items():
            lay.plan = (generation, plan)
            if lay in changed or retrace:
                logging.info("%s", plan.table())
        return bool(changed or retrace)

    def pin(self, choice) -> bool:
        """See ``CompressedAllReduce.pin_plan``."""
        # Every worker's choice checked, then compared (a checksum each; 0: refused),
        # before anything else is gathered: a worker that refused its choice or pinned
        # another would otherwise leave the others waiting in a collective.
        try:
            checked, refused = self._checked_pin(choice), None
        except ValueError as exc:
            checked, refused = None, exc
        word = 0 if refused else zlib.crc32(
            json.dumps(checked, sort_keys=True).encode()) & 0x7FFFFFFF or 1
        words = self._ops.gather_words([word])[:, 0].tolist()
        if refused is not None:
            raise refused
        if len(set(words)) > 1:
            raise ValueError("pin_plan: the workers' choices differ or some refused theirs "
                             f"(checksums by replica, 0: refused: {words}); every worker "
                             "must pin the same, at the same point")
        if checked is None and self._pin is None:
            return False  # nothing pinned: the planner's own plan stays as it is
        previous, self._pin = self._pin, checked
        try:
            active = self._active()
            if not active:
                return False  # the next trace plans as pinned
            figures = self._pinned_figures(self._figures[1])
            plans = {}
            for lay in active:
                self._count_rows(lay)
                plans[lay] = self._planned(lay, figures)
                self._check_agree(plans[lay])
            return self._take(plans, figures)
        except BaseException:
            self._pin = previous
            raise

    def _checked_pin(self, choice):
        """``choice`` as ``pin`` keeps it, or a ValueError naming what is wrong."""
        labels = ", ".join(planner.BY_LABEL)
        if choice is None:
            return None
        if isinstance(choice, str):
            if choice not in planner.BY_LABEL:
                raise ValueError(f"pin_plan: `choice` {choice!r} is not a candidate; "
                                 f"one of {labels}, a dict of them by gradient, or None")
            return choice
        if not isinstance(choice, dict) or not choice:
            raise ValueError(f"pin_plan: `choice` must be a candidate's label ({labels}), "
                             f"a non-empty dict of them by gradient name, or None; got "
                             f"{choice!r}")
        keys = [name for name in choice if not isinstance(name, str)]
        if keys:
            raise ValueError(f"pin_plan: `choice`'s keys must be gradient names (str); "
                             f"got {keys!r}")
        bad = {name: label for name, label in choice.items()
               if not isinstance(label, str) or label not in planner.BY_LABEL}
        if bad:
            raise ValueError(f"pin_plan: `choice` has labels that are not candidates: {bad} "
                             f"(candidates: {labels})")
        known = {g[0] for lay in self._layouts.values() for g in lay.gradients}
        if not known:
            raise ValueError("pin_plan: `choice` by gradient name needs a planned step "
                             "first (the names are those of compression_plan()'s entries); "
                             "a single label pins every gradient from the first step")
        unknown = sorted(set(choice) - known)
        if unknown:
            raise ValueError(f"pin_plan: `choice` names gradients that no plan has: "
                             f"{unknown}; planned: {sorted(known)}")
        return dict(choice)

    def _pinned_label(self, name):
        """What the pin sends the gradient ``name`` as."""
        return self._pin if isinstance(self._pin, str) else self._pin.get(name, "fp32")

    def _pinned_figures(self, figures):
        """``figures`` with the CPU timings of the measured candidates the pin names
        (low rank, top-k), measured now where missing (every worker at once)."""
        labels = ({self._pin} if isinstance(self._pin, str) else
                  set(self._pin.values()) if self._pin else set())
        if any(planner.BY_LABEL[label].error_key is not None for label in labels):
            with tf.init_scope():  # the first trace's plan asks too
                figures = planner.measure_low_rank(self._ops, figures)
        return figures

    def replan(self, margin: float, due=None) -> bool:
        """See ``CompressedAllReduce.replan``."""
        check_number("margin", margin, 0)
        if due is not None and not self._ops.gather_words([int(bool(due))])[0][0]:
            return False
        active = self._active()
        if not active:
            return False
        old = self._figures[1]
        new = planner.measure_link(self._ops, old)
        if not any(planner.link_changed(old, new, lay.plan[1], margin) for lay in active):
            return False
        logging.info("tfgc: compressor='auto': the link changed (%s, was %s)",
                     new.describe(), old.describe())
        plans = {}
        for lay in active:
            self._count_rows(lay)
            plans[lay] = self._planned(lay, new)
        return self._take(plans, new)

    def track_regimes(self):
        """See ``CompressedAllReduce.track_regimes``."""
        if self._tracked:
            # Another fit: steps a layout summed before it (another model's fit) do not
            # make it one that trains now.
            with tf.init_scope():
                for lay in self._layouts.values():
                    lay.restart_counts()
            return
        self._tracked = True
        for lay in self._layouts.values():
            lay.start_regimes()
        active = self._active()
        if active:
            figures = self._figures[1]
            for lay in active:
                self._count_rows(lay)
            self._take({lay: self._planned(lay, figures) for lay in active}, figures,
                       retrace=True)

    def adapt(self, threshold: float, min_gain_s: float = 0.0, step_s=None,
              step_se_s=None, steps_left=None, learning_rate=None,
              trial_steps=None, noise: float = 1.0) -> frozenset:
        """See ``CompressedAllReduce.adapt``."""
        check_number("threshold", threshold, 0, strict=True)
        check_number("noise", noise, 0)
        check_number("min_gain_s", min_gain_s, 0)
        _check_step(step_s, step_se_s)
        _check_steps_left(steps_left)
        _check_steps_left(trial_steps, "trial_steps")
        if learning_rate is not None:
            check_number("learning_rate", learning_rate, 0, also=" or None")
        if not self._tracked:
            raise ValueError("adapt() needs track_regimes() and a step under "
                             "compressor='auto' first")
        active = self._active()
        if not active:
            # No plan in this generation: the policy sends every gradient dense (a small
            # model), or no step has run since. Nothing is in a regime.
            return frozenset()
        # Worker 0's norms and summed steps of each layout, least gain, step and its
        # error (as the bits of float32 words), so every worker decides alike.
        values, starts = [], {}
        with tf.init_scope():
            for lay in active:
                starts[lay] = len(values)
                places = range(len(lay.gradients))
                values += [float(tf.norm(lay.sums[j])) if j in lay.sums else float("nan")
                           for j in places]
                values += [float(lay.squares[j].numpy()) if j in lay.squares
                           else float("nan") for j in places]
                values += [lay.summed_steps(), lay.reached_steps()]
                for total in list(lay.sums.values()) + list(lay.squares.values()):
                    total.assign(tf.zeros_like(total))
                lay.restart_counts()
        first = self._first_floats(values + [min_gain_s, _or_nan(step_s), _or_nan(step_se_s),
                                             _or_nan(learning_rate), _or_nan(trial_steps)]
                                   + self._timing_words(steps_left), most=1)
        min_gain_s, step_s, step_se_s, rate, trial_steps = (float(v) for v in first[-7:-2])
        rate = rate if math.isfinite(rate) else None
        ran = [lay for lay in active if first[starts[lay] + 2 * len(lay.gradients)]]
        self._timed(ran, step_s, step_se_s)
        for lay in ran:
            start, count = starts[lay], len(lay.gradients)
            steps = float(first[start + 2 * count])
            now = {j: planner.interval_norm(float(first[start + j]),
                                            float(first[start + count + j]), steps)
                   for j in range(count)}
            reasons = planner.critical_reasons(lay.norms, now, threshold, noise)
            lay.critical = frozenset(lay.gradients[j][0] for j in reasons)
            if lay.norms:  # the first interval's are all critical, as said at its start
                counts = collections.Counter(reasons.values())
                logging.info("tfgc: compressor='auto': %d of %d gradients critical at the "
                             "interval's end (%s)", len(reasons), count,
                             ", ".join(f"{why}: {n}" for why, n in sorted(counts.items()))
                             or "none moved by the threshold")
            lay.held = {}
            if planner.learning_rate_fell(lay.learning_rate, rate, threshold):
                # ACCORDION's rule at a decay: the next interval compresses less, every
                # gradient of the model as if its norm had moved, and none goes lossier
                # than the plan that ran sent it (``planner.make_plan``'s ``held``).
                logging.info("tfgc: compressor='auto': the learning rate fell from %.3g to "
                             "%.3g over the interval (by %.0f%%, at least the threshold's "
                             "%.0f%%): every gradient is critical for the next, and none "
                             "goes lossier than it went", lay.learning_rate, rate,
                             100 * (lay.learning_rate - rate) / lay.learning_rate,
                             100 * threshold)
                lay.critical = frozenset(g[0] for g in lay.gradients)
                ran_plan = lay.plan[1] if lay.plan is not None else None
                lay.held = {e.name: e.label for e in ran_plan.entries} if ran_plan else {}
            lay.norms = now
            lay.learning_rate = rate
        if self._ops.compressor.budget_rank and ran:
            self._measured(ran, step_s, *first[-2:], min_gain_s=min_gain_s)
        # Planned again every time: the regimes, the low-rank errors or the steps timed
        # (the pace) may have moved, and a new plan is taken only where it pays. A
        # layout that no step summed in the interval (a model not trained in it) is
        # left as it was, and a new generation leaves it behind (its train function,
        # traced again, plans it again from its regimes; the planner may forget it).
        self._take(self._decide(ran, min_gain_s, _trial_share(trial_steps, first)),
                   self._figures[1])
        # What is critical now in the models trained in the interval: one whose every
        # step was skipped for a non-finite gradient (nothing summed) keeps the regimes
        # it had, and its plan still follows them; a model not trained in it is left
        # out (another fit's, or one frozen since).
        trained = [lay for lay in active if first[starts[lay] + 2 * len(lay.gradients) + 1]]
        return frozenset().union(*(
            (frozenset(g[0] for g in lay.gradients) if lay.critical == "all" else lay.critical)
            for lay in trained))

    def measure_low_rank(self, step_s=None, step_se_s=None, steps_left=None,
                         min_gain_s: float = 0.0, trial_steps=None) -> bool:
        """See ``CompressedAllReduce.measure_low_rank``."""
        _check_step(step_s, step_se_s)
        _check_steps_left(steps_left)
        _check_steps_left(trial_steps, "trial_steps")
        check_number("min_gain_s", min_gain_s, 0)
        active = self._active()
        if not self._tracked or not active or not self._ops.compressor.budget_rank:
            return False
        # Worker 0's count of the steps each layout summed: those that train now.
        with tf.init_scope():
            summed = [lay.summed_steps() for lay in active]
        first = self._first_floats(summed + [min_gain_s, _or_nan(step_s), _or_nan(step_se_s),
                                             _or_nan(trial_steps)]
                                   + self._timing_words(steps_left), most=1)
        min_gain_s, step_s, step_se_s, trial_steps = (float(v) for v in first[-6:-2])
        ran = [lay for lay, count in zip(active, first[:-6]) if count]
        self._timed(ran, step_s, step_se_s)
        if not ran or not self._measured(ran, step_s, *first[-2:], min_gain_s=min_gain_s):
            return False
        return self._take(self._decide(ran, min_gain_s, _trial_share(trial_steps, first)),
                          self._figures[1])

    def _timing_words(self, steps_left):
        """The steps left (NaN: unknown) and the seconds timing the measured candidates
        would take on this worker (``planner.measured_timing_s``; NaN: unknown), for
        ``_first_floats``: worker 0's steps and the most seconds of any worker (all
        wait for the slowest) decide whether they are timed."""
        figures = self._figures[1]
        timing_s = 0.0
        if self._ops.compressor.budget_rank and not planner.measured(figures):
            timing_s = planner.measured_timing_s(figures.num_workers, figures)
        return [_or_nan(steps_left), _or_nan(timing_s)]

    def _saving_bound(self, layouts, step_s) -> float:
        """At most what the measured candidates could save a step: what the gradients
        they may take (the matrices) cost in the current plans, CPU and wire, scaled as
        the steps that ran measured the plans' communication (the steepest slope their
        noise allows where they measured one; where they did not, the scale of the pace
        they give, the prediction as it is or the step over it where the step is the
        shorter: ``planner.pace_from``; before any step, the most ``planner.Pace``
        allows), and no more than the step measured (on a measured link: a given one,
        ``Auto.link_gbps``, is not the one the steps ran on, and its savings are the
        ones planned for)."""
        total = 0.0
        for lay in layouts:
            plan = lay.plan[1]
            names = {lay.gradients[j][0] for j in lay.matrix_places()}
            cost = sum(e.cpu_s + e.wire_s for e in plan.entries if e.name in names) \
                + sum(t.cpu_s + t.wire_s for t in plan.rows_tables if t.name in names)
            pace = plan.pace
            scale = planner.PACE_SCALE[1] if pace is None else \
                max(p.scale for p in (pace,) + tuple(pace.others))
            total += cost * scale
        measured = math.isfinite(step_s) and step_s > 0 and not self._figures[1].link_gbps
        return min(total, step_s) if measured else total

    def _measured(self, layouts, step_s=float("nan"), steps_left=float("nan"),
                  timing_s=float("nan"), min_gain_s: float = 0.0) -> bool:
        """Measures the low-rank errors of ``layouts`` again (and, the first time, the
        low-rank candidates' CPU cost); whether they changed. Where their CPU cost is
        not measured yet and timing it (``timing_s`` seconds) cannot pay over the
        ``steps_left`` steps left of the fit (``planner.timing_pays``), neither is
        measured: they could not be planned in time to win back what they cost. What
        they could save a step is less the gain a change of plan must make
        (``planner.required_gain`` of ``min_gain_s``, as the current plans' slopes
        stand): a timing is repaid only through a change, which pays for its retrace
        first. Worker 0's ``steps_left``, ``timing_s`` and ``min_gain_s``."""
        figures = self._figures[1]
        if not planner.measured(figures):
            saving_s = self._saving_bound(layouts, step_s)
            change_s = max(planner.required_gain(lay.plan[1], min_gain_s)
                           for lay in layouts)
            if not planner.timing_pays(max(saving_s - change_s, 0.0), steps_left, timing_s):
                note = (f"tfgc: compressor='auto' left the low-rank and top-k candidates "
                        f"untimed: they could save at most {saving_s * 1e3:.2f} ms a step, "
                        f"{change_s * 1e3:.2f} ms of which a change of plan needs for its "
                        f"retrace; {max(saving_s - change_s, 0.0) * steps_left:.1f} s over the "
                        f"{steps_left:.0f} steps left of the fit, and timing them would "
                        f"take about {timing_s:.1f} s (a longer fit times them, and keeps "
                        "their timings for later jobs)")
                if self.untimed is None:  # said once, not at every interval's end
                    logging.info("%s", note)
                    self.untimed = note
                if self._capture is not None:
                    with tf.init_scope():
                        self._capture.assign(False)  # until the next ``capture``
                return False
        self.untimed = None
        figures = planner.measure_low_rank(self._ops, figures)
        if figures is not self._figures[1]:
            logging.info("tfgc: compressor='auto' measured the low-rank candidates: %s",
                         figures.describe())
            self._figures = (self._figures[0], figures)
        low_rank = dict(self._low_rank)
        with tf.init_scope():
            for lay in layouts:
                names = {g[0] for g in lay.gradients}
                low_rank = {name: errors for name, errors in low_rank.items()
                            if name not in names}
                low_rank.update(self._measure_low_rank(lay))
            if self._capture is not None:
                self._capture.assign(False)  # until the next ``capture``
        changed = low_rank != self._low_rank
        self._low_rank = low_rank
        return changed

    def _plan_again(self, lay, current, min_gain_s: float = 0.0, ran=None,
                    trial_share: float = 0.0):
        """The plan for ``lay`` from the current figures, regimes and errors: one that
        differs from ``current``, unless ``current`` still keeps within the regimes and
        budgets and the new one is predicted to save less than ``min_gain_s`` a step
        (twice that while no slope is measured: ``planner.required_gain``), under the
        pace and the paces its measured slope allows (``planner.change_pays``; or
        twice that at the pace, and ``trial_share`` of what it would lose at the worst
        of them, as a trial, where it loses nothing within one standard error of the
        slope: ``planner.is_trial``): a change retraces the
        train function, which costs seconds, and a new rank that saves a tenth of a
        millisecond does not pay that back, nor does one that only
        the steps' noise favours; then ``current`` priced anew. Once two plans or more
        have been timed on a measured link, the plans timed beside the other layouts'
        plans of now (made again from their keys: ``_timed_plans``) weigh by their own
        steps over the prediction (``planner.prefer_timed``): a plan that ran slower
        than one timed before gives way to that one, and the new plan is tried only
        where it is predicted to beat every plan timed, the current one included;
        where the regimes or budgets now rule the current plan out (a critical regime
        begins), the cheapest of the timed plans they allow is taken over the new one
        where it ran faster than the new one is predicted to. On a given link
        (``link_gbps``) the steps run on another network than the one planned for, so
        only the pace's line reads them. ``ran``: the layouts that trained in the
        interval (None: those planned now), whose plans beside ``lay``'s the timed
        steps must have run. The planner's choice is kept as ``lay.proposed``. Its
        callers have counted the tables' rows."""
        figures = self._figures[1]
        plan = lay.proposed = self._planned(lay, figures)
        timed = {}
        if (self._pin is None and not self._ops.compressor.link_gbps
                and plan.pace is not None and len(lay.steps) > 1):
            timed = self._timed_plans(lay, figures, current, ran)
            kept = timed.get(current.key(), (None,))[0]
            # Weighed by the steps where the current plan was timed and is priced now,
            # or where the regimes or budgets now rule it out (a plan must be left).
            if kept is not None or (timed and self._as_running(lay, figures, current)
                                    is None):
                taken = planner.prefer_timed(plan, kept, timed, min_gain_s)
                if taken is not None:
                    return taken
        if plan.key() == current.key():
            return plan
        kept = None
        if min_gain_s > 0 or plan.slope_measured:
            # Priced now: among the timed plans already, where it is one.
            kept = (timed[current.key()][0] if current.key() in timed
                    else self._as_running(lay, figures, current))
        def saved(seconds):
            return (f"save {seconds * 1e3:.3f} ms" if seconds >= 0
                    else f"lose {-seconds * 1e3:.3f} ms")

        if planner.change_pays(kept, plan, min_gain_s, trial_share):
            least = None if kept is None else planner.least_gain(kept, plan)
            if least is not None and least < planner.required_gain(plan, min_gain_s):
                logging.info("tfgc: compressor='auto' tries a new plan: it would %s a step "
                             "at the measured pace, %s within one standard error of its "
                             "slope and %s at the worst pace the steps allow; its steps "
                             "will say whether it stays",
                             saved(planner.fitted_gain(kept, plan)),
                             saved(planner.least_gain(kept, plan, near=True)), saved(least))
            return plan
        # Not taken: ``kept`` is not None here (``change_pays`` takes any plan over none).
        trial = ""
        if plan.slope_measured:
            trial = (f"; nor is it a trial, which must save "
                     f"{planner.trial_gain(kept, plan, min_gain_s, trial_share) * 1e3:.3f} "
                     f"ms at the measured pace (twice the change, and what it would lose "
                     f"over its trial's steps at the worst pace) and lose nothing at one "
                     f"standard error of its slope, where it would "
                     f"{saved(planner.least_gain(kept, plan, near=True))}")
        logging.info("tfgc: compressor='auto' keeps its plan: the new one would %s a "
                     "step at the measured pace and %s at the worst pace the steps "
                     "allow, which does not cover a change (%.3f ms a step over the "
                     "steps it would run%s)%s",
                     saved(planner.fitted_gain(kept, plan)),
                     saved(planner.least_gain(kept, plan)),
                     planner.required_gain(plan, min_gain_s) * 1e3,
                     "" if plan.slope_measured else ", and the change back its steps may "
                     "call for: no slope is measured yet", trial)
        if kept.key() in timed:
            # The new plan was predicted to beat every plan timed but does not pay for
            # a change: a plan timed faster than the current one still may.
            return planner.prefer_timed(kept, kept, timed, min_gain_s)
        return kept

    def _beside(self, lay, ran=None):
        """The plans of the layouts beside ``lay`` in ``ran`` (the layouts that
        trained in the steps; None: those planned now), by their keys
        (``_Layout.beside``)."""
        return ";".join(sorted(other.plan[1].key()
                               for other in (self._active() if ran is None else ran)
                               if other is not lay))

    def _timed_plans(self, lay, figures, current, ran=None):
        """The plans ``lay`` ran and timed (its ``steps``, restored ones included)
        beside the plans the other layouts in ``ran`` run now (a step holds every
        layout's runs; None: the layouts planned now) that the current regimes and
        budgets still allow, each priced now with its timed step, by key
        (``planner.prefer_timed``'s ``timed``); {} where ``current`` was not timed
        beside them."""
        now = self._beside(lay, ran)
        if lay.beside.get(current.key()) != now or current.key() not in lay.steps:
            return {}
        timed = {}
        for key, point in lay.steps.items():
            if lay.beside.get(key) != now:
                continue
            plan = self._rebuilt(lay, figures, key)
            if plan is not None:
                timed[key] = (plan, point)
        return timed

    def _rebuilt(self, lay, figures, key):
        """The plan of ``lay`` whose key is ``key`` (``_choice_of``), priced under
        ``figures`` and the current regimes and budgets; None where they rule it out or
        the key does not name a plan of ``lay`` whole."""
        if not _names_fit(key, lay.gradients):
            return None
        labels, dense, rows_label = _choice_of(key, lay.gradients)
        plan = self._planned(lay, figures, only=labels, dense=dense, rows_label=rows_label)
        return plan if plan is not None and plan.key() == key else None

    def _decide(self, ran, min_gain_s: float = 0.0, trial_share: float = 0.0):
        """The plans to take for the layouts in ``ran`` (those that trained in the
        interval): each one's ``_plan_again``, then, where several ran (a step reduces
        each of them), the whole step's choice among the sets of plans that ran
        together (``_joint_back``). Where a layout takes a plan that is neither its
        current one nor the planner's choice, the step's plans went back to plans
        timed faster: counted once (``went_back``) and said. Every worker calls it at
        the same point."""
        plans = {lay: self._plan_again(lay, lay.plan[1], min_gain_s, ran, trial_share)
                 for lay in ran}
        if len(ran) > 1 and self._pin is None and not self._ops.compressor.link_gbps:
            plans = self._joint_back(ran, plans, min_gain_s)
        back = [lay for lay in ran
                if plans[lay].key() not in (lay.plan[1].key(), lay.proposed.key())]
        if back:
            self.went_back += 1
            logging.info("tfgc: compressor='auto' goes back to plans whose steps ran "
                         "faster than the current ones: %s",
                         " | ".join(plans[lay].key() for lay in back))
        return plans

    def _joint_back(self, ran, plans, min_gain_s):
        """``plans`` for the layouts in ``ran``, or the plans that ran together in a
        timed step instead (``planner.prefer_timed`` over ``planner.Joint``): a step
        holds every layout's runs, and where they change plan at the same interval's
        end (a GAN's two sets, out of their critical regimes at once), no layout's own
        steps compare its plans beside the same plans of the others (``_timed_plans``);
        the sets of plans that ran together do. Each is priced now with its whole
        step, moved along the line through the steps they timed together; the
        layouts' new plans are tried only where predicted to beat every set timed,
        the current one included. Where fewer than two sets were timed together, the
        current set not among them, or the regimes or budgets rule one of its plans
        out, ``plans`` stand."""
        figures = self._figures[1]
        together, points = self._timed_together(ran, figures)
        pace = planner.pace_from(points, self._ops.compressor.low_rank_steps)
        current = "\n".join(lay.plan[1].key() for lay in ran)
        if pace is None or current not in together or len(together) < 2:
            return plans
        timed = {key: (planner.Joint(chosen, pace), point)
                 for key, (chosen, point) in together.items()}
        kept = timed[current][0]
        new = planner.Joint(tuple(plans[lay] for lay in ran), pace)
        taken = planner.prefer_timed(new, kept, timed, min_gain_s)
        if taken is None:
            return plans
        if taken.key() == kept.key() != new.key():
            logging.info("tfgc: compressor='auto' keeps the plans of the sets a step "
                         "reduces: their new plans are not predicted to beat the plans "
                         "timed together")
        return dict(zip(ran, taken.plans))

    def _timed_together(self, ran, figures):
        """The sets of plans the layouts in ``ran`` ran together and timed: each
        layout's ``steps`` keys with the keys ``beside`` them, matched to the layouts by
        the names the keys hold. Returns the sets (their plans, in ``ran``'s order,
        priced now under the current regimes and budgets; by their keys joined as
        ``planner.Joint.key`` joins them) with their steps, and the steps of every
        set, those now ruled out included (the points of the line through whole steps
        of all of them). A set that held another layout's plan, or a key that names no
        plan of one whole, is left out. A key's ``steps`` is its last step, which every
        layout in the set wrote, so whichever layout's rows name a set agree."""
        rebuilt, together, points = {}, {}, {}
        for lay in ran:
            for key, point in lay.steps.items():
                if key not in lay.beside:
                    continue
                keys = [k for k in [key] + _BESIDE_SPLIT.split(lay.beside[key]) if k]
                chosen = []
                for other in ran:
                    found = [k for k in keys if _names_fit(k, other.gradients)]
                    if len(found) != 1:
                        break
                    chosen.append(found[0])
                if len(chosen) != len(ran) or len(keys) != len(ran):
                    continue
                points[_point_key(point)] = point
                for other, k in zip(ran, chosen):
                    if (other, k) not in rebuilt:
                        rebuilt[other, k] = self._rebuilt(other, figures, k)
                plans = tuple(rebuilt[other, k] for other, k in zip(ran, chosen))
                if all(plan is not None for plan in plans):
                    together.setdefault("\n".join(chosen), (plans, point))
        return together, list(points.values())

    @property
    def norms(self):
        """The last interval's norms of the gradients reduced last, by place in their
        layout (the planned gradients and the embedding tables, in order)."""
        lay = self._shown()
        return {} if lay is None else dict(lay.norms)

    @property
    def figures(self):
        """The current figures (``planner.Figures``), or None before the first plan."""
        return None if self._figures is None else self._figures[1]


# Where the keys of the plans beside a layout's (``_Layout.beside``) join: each key
# starts "auto:" (``planner.Plan.key``).
_BESIDE_SPLIT = re.compile(r";(?=auto:)")


def _choice_of(key, layout):
    """A plan's choice from its ``key`` (``planner.Plan.key``) for the gradients of
    ``layout``: its labels by name, the places among the tables it sent dense, and what
    its tables' rows went as (None: no rows); (None, None, None) where the key is not
    one. A name with ``;`` in it does not come back whole; the plan made from it then
    has another key, and its caller leaves it out."""
    if not key.startswith("auto:"):
        return None, None, None
    labels, rows_label = {}, None
    for part in key[len("auto:"):].split(";"):
        name, sep, sent = part.rpartition("=")
        if not sep or not name:
            return None, None, None
        if sent.startswith("rows:"):
            rows_label = sent[len("rows:"):]
        else:
            labels[name] = sent.partition("@")[0]
    dense = frozenset(p for p, k in enumerate(_table_places(layout))
                      if layout[k][0] in labels)
    return labels, dense, rows_label


def _point_key(point):
    """A timed step (``_Layout.steps``' value) as a key: the same step kept by two
    layouts is one point (NaN, an unknown error, compares unequal to itself)."""
    return tuple(v if math.isfinite(v) else None for v in point)


def _names_fit(key, layout) -> bool:
    """Whether ``key`` names a choice for gradients of ``layout`` (``_choice_of``)."""
    labels = _choice_of(key, layout)[0]
    return labels is not None and set(labels) <= {g[0] for g in layout}


def _planned_places(layout, plan):
    """The places in ``layout`` of ``plan``'s entries, in order."""
    dense = plan.dense_places
    tables = {k: p for p, k in enumerate(_table_places(layout))}
    return [k for k in range(len(layout)) if k not in tables or tables[k] in dense]


def _traced(variables):
    """The tables' (name, shape) as the plan's ``Table`` lines name them."""
    return [(base.name_of(v), tuple(tf.TensorShape(v.shape).as_list())) for v in variables]


def _table_places(layout):
    """The indices of the embedding tables in a plan's layout (``plan_for``)."""
    return [k for k, g in enumerate(layout) if len(g) > 3]


def _layout_key(gradients) -> str:
    """A layout's gradients as a record writes them (JSON: tuples become lists)."""
    return json.dumps(gradients)


def _saved_tables_of(parts, traced):
    """The tables of the first of a record's ``parts`` whose tables are ``traced``
    (``_traced``'s (name, shape) pairs), as the record keeps them; None if none."""
    for part in parts:
        tables = part.get("tables") or []
        if [(t[1], tuple(t[2])) for t in tables] == traced:
            return tables
    return None


def _dense_places(tables):
    """The places of a record's ``tables`` that its plan sent dense."""
    return frozenset(t[0] for t in tables if t[3])


def steps_from_record(rows) -> dict:
    """The plans' timed steps as ``snapshot`` wrote them ([key, communication, step,
    standard error or None] rows), by key; an error of None, or a row written before
    steps had one, is unknown (NaN: ``planner.pace_from`` takes ``PACE_PRIOR``)."""
    return {key: (float(comm), float(step),
                  float("nan") if len(rest) == 0 or rest[0] is None else float(rest[0]))
            for key, comm, step, *rest in rows}


def _check_step(step_s, step_se_s=None):
    if step_s is not None:
        check_positive_float("step_s", step_s)
    if step_se_s is not None and check_number("step_se_s", step_se_s, 0) == float("inf"):
        raise ValueError(f"`step_se_s` must be finite, got {step_se_s!r}")


def _check_steps_left(steps_left, name="steps_left"):
    if steps_left is not None:
        check_number(name, steps_left, 0, also=" or None")


def _trial_share(trial_steps, first):
    """``planner.trial_share_of`` worker 0's ``trial_steps`` (NaN: None) and steps left
    (``_timing_words``' first word in ``first``, as ``_first_floats`` returns them)."""
    return planner.trial_share_of(trial_steps, float(first[-2]))


def _or_nan(step_s):
    """A measured step as a word carries it: NaN for none."""
    return float("nan") if step_s is None else step_s


def _error_key(key: str):
    """A measured error's key as a record keeps it (a string) back as
    ``planner.Candidate.error_key`` has it: a rank, or top-k's label."""
    return int(key) if key.isdigit() else key
