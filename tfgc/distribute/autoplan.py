"""``compressor="auto"`` in a running strategy: its plan measured, made, checked, kept
and adapted (``AutoPlanner``); what a plan is and how it is chosen is ``planner``.

The cross-device ops hold one ``AutoPlanner`` and ask it for the plan of each traced
gradient reduction (``plan_for``). A plan belongs to the ops' *generation* (it goes
up with every change of setting, and each change retraces the train functions):
the first trace of a generation measures (every worker at once: the figures need
collectives) and plans, later traces of the same gradients reuse the plan. Between
steps, ``replan`` (the link measured again) and ``adapt`` (the end of an interval of
training: ACCORDION's critical regimes, and the low-rank errors measured again) and
``measure_low_rank`` (the first of those measurements, after the first step) may make
a new plan, which ``_adopt`` hands to the next step by starting a new generation with
the plan and figures ready, so that trace measures nothing.

Checkpoints: the owner of the compression state (the optimizer) also tracks a
``PlanRecord``, which saves what the plan was made from (the gradients, the agreed
figures, the critical set, the last norms and low-rank errors, the steps timed under
each plan) and the plan itself. Restored before the first step (Keras'
``BackupAndRestore``, a ``tf.train.Checkpoint`` restored into a new optimizer), it
reaches the planner when the record is attached, just before the first plan, and that
plan is the saved one, priced under the saved figures, instead of measuring again (or,
where the restored regimes and budgets rule it out, a plan made from them). The link
alone is measured again first (``planner.measure_link``, a fraction of a second): a
checkpoint restored on another network, where a float32 all-reduce of the planned
gradients takes ``RESTORED_LINK_FACTOR`` times as long or as short, is planned afresh
for that network, from the restored CPU timings, regimes and low-rank errors but none
of the steps timed on the old one. Its
embedding tables go as the saved plan sent them from the first trace on (dense or as
rows, priced with the rows it counted: ``dense_tables``). The workers
first agree that they all restored the same record (an all-gather of their checksums);
otherwise they all measure.
"""

import json
import math
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
_RECORD_FORMAT = 1
# A restored plan is kept unless the link measured at the restore predicts a float32
# all-reduce of its gradients this many times slower or faster than the saved figures
# did. Link classes differ by 10x (100 Mbit/s, 1, 10 Gbit/s); the probe of one link
# moved by up to 2.2x on a loaded 2-core host (the hop at 1.5 and 3.3 ms), which must
# not undo a restored plan (AutoPlanCallback's ``link_margin`` re-plans later, on
# its own interval).
RESTORED_LINK_FACTOR = 3.0


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
        # A checkpoint's record, restored and not yet used by a plan; and, for the
        # generation's first trace, the places among the tables that its plan sent dense
        # (generation, traced tables, places: ``dense_tables``).
        self._saved = None
        self._saved_dense = None
        # By place among the embedding tables: this worker's rows of the last step (a
        # local int32 variable: distinct rows, rows with repeats; zeros: not counted),
        # and every worker's most as last gathered (``_count_rows``).
        self._counts, self._rows = {}, {}
        # How many times the figures were measured (a restored plan measures only the
        # link), and how many restored plans the link measured then made afresh.
        self.measurements = 0
        self.relinked = 0
        self.reset()

    def reset(self):
        """Another compressor: the next plan starts afresh, no regimes tracked."""
        # Places below are indices in the plan's *layout*: the planned gradients and the
        # embedding tables, in the gradients' order (``plan_for``), the same whichever
        # tables go dense.
        # The names of the gradients in a critical regime ("all": every one, until the
        # first interval ends), the last interval's norms and, by place, a sum of each
        # planned gradient's reduced values over the interval (None: regimes not
        # tracked).
        self._critical, self._norms, self._sums = frozenset(), {}, None
        # With regimes tracked and low-rank candidates on: by place, each matrix's last
        # kept local gradient (worker 0's only; a table sent as rows, densified) and its
        # variable (whose residual the measurement adds), and worker 0's last
        # measurement by name (``planner.LowRank.errors``).
        self._last, self._last_vars, self._low_rank = {}, {}, {}
        # Whether the next step keeps those gradients (``capture``; worker 0's: a copy
        # of the matrices every step would cost the step a pass over them), and the
        # places of the planned gradients and of the tables sent as rows that are
        # matrices (on every worker).
        self._capture, self._matrices, self._row_matrices = None, [], []
        # The plans that ran, by key: (predicted communication, worker 0's measured
        # median step, its standard error), seconds (``planner.pace_from``).
        self._steps = {}
        self._forget_rows()  # rows counted under another model are no count of this one's

    def _new_layout(self):
        """Other gradients are planned (another model trained under the strategy, or
        layers frozen or thawed): what was tracked by place in the old layout (interval
        sums, norms, the kept matrices) and the steps timed under its plans belong to
        it, so the regimes start again, every gradient critical, and the pace with them.
        The low-rank errors, by gradient name, stay. Models trained in turn thus start
        their regimes again at each change."""
        if self._sums is not None:
            logging.info("tfgc: compressor='auto': other gradients are planned (another "
                         "model, or other trainable variables); the critical regimes "
                         "start again")
            self._start_regimes()
        self._last, self._last_vars = {}, {}
        self._matrices, self._row_matrices = [], []
        self._steps = {}

    def _start_regimes(self):
        """No interval summed yet: every gradient critical until two intervals compare."""
        self._sums, self._critical, self._norms = {}, "all", {}

    def _forget_rows(self):
        self._rows = {}
        with tf.init_scope():
            for count in self._counts.values():
                count.assign(tf.zeros([2], tf.int32))

    @property
    def plan(self):
        """The current generation's plan, or None."""
        if self._plan is None or self._plan[0] != self._ops.generation:
            return None
        return self._plan[2]

    def row_compressor(self):
        """What the embedding rows travel as under the current plan (its tables' label,
        ``planner.row_candidate``), or None: the stock gather."""
        plan = self.plan
        if plan is None:
            return None
        if plan.tables:
            candidate = planner.BY_LABEL[plan.tables[0].label]
        else:
            candidate = planner.row_candidate(plan.entries, plan.error_budget,
                                              plan.num_workers)
        return None if candidate is None else candidate.compressor

    def dense_tables(self, variables=None, owner=None) -> frozenset:
        """The places among the embedding tables (in the gradients' order) that the
        current generation's plan sends as dense gradients; with ``variables`` (the
        tables traced), none unless they are the plan's tables (another model). Before
        the generation's first plan, with ``variables``: the places a restored
        checkpoint's plan sent dense (``_restored_dense``; ``owner``: the state's
        owner, which a deferred restore reaches), so that its first step sends the
        tables as the saved plan did."""
        plan = self.plan
        if plan is None:
            return self._restored_dense(variables, owner) if variables else frozenset()
        if variables is not None and [(t.name, t.shape) for t in plan.tables] != _traced(
                variables):
            return frozenset()
        return frozenset(t.place for t in plan.tables if t.dense)

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
            saved = (self._saved or {}).get("tables") or []
            usable = [(t[1], tuple(t[2])) for t in saved] == traced
            places = frozenset()
            if self._all_restored(json.dumps(saved) if usable else None):
                places = frozenset(t[0] for t in saved if t[3])
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
        if self._is_current(layout, dense):
            return self._plan[2]
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is not None and len(self._ops.local_devices) > 1:
            # Replica threads take turns; the measurements run once, in the merge.
            replica_ctx.merge_call(lambda _: self._make(layout, owner, dense))
        else:
            self._make(layout, owner, dense)
        return self._plan[2]

    def _is_current(self, layout, dense) -> bool:
        return (self._plan is not None and self._plan[:2] == (self._ops.generation, layout)
                and self.dense_tables() == dense)

    def _make(self, gradients, owner, dense=frozenset()):
        generation = self._ops.generation
        if self._is_current(gradients, dense):
            return
        self._attach(owner)  # a deferred checkpoint restore reaches ``restored`` here
        if self._plan is not None and self._plan[1] != gradients:
            self._new_layout()
        if self._plan is None or _tables_of(self._plan[1]) != _tables_of(gradients):
            self._forget_rows()  # other tables: what was counted is not theirs
        self._count_rows(gradients)
        auto = self._ops.compressor
        labels = rows_label = None
        if self._figures is None or self._figures[0] != generation:
            figures, labels, rows_label = self._restored_figures(gradients)
            moved = figures is not None and self._moved_link(gradients, figures)
            if moved:
                figures, labels, rows_label = moved, None, None
            if figures is None:
                started = time.perf_counter()
                figures = planner.measure(self._ops, auto.link_gbps, auto.latency_ms)
                self.measurements += 1
                logging.info("tfgc: compressor='auto' measured in %.1f s: %s",
                             time.perf_counter() - started, figures.describe())
            self._figures = (generation, figures)
        plan = None
        if labels:
            # The saved plan itself, where the restored regimes and budgets still allow
            # it: a plan made afresh could differ (a change kept out because it did not
            # pay, steps timed after the plan was made).
            # Its tables' rows too, in what they went as then.
            plan = self._planned(gradients, self._figures[1], only=labels, dense=dense,
                                 rows_label=rows_label)
        if plan is None:
            plan = self._planned(gradients, self._figures[1], dense=dense)
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
                "labels": {e.name: e.label for e in plan.entries},
                "gradients": json.loads(json.dumps(self._plan[1])),
                "num_workers": figures.num_workers,
                "candidates": [c.label for c in planner.ALL],
                "link_us": list(figures.link_us),
                "encode_us": {k: list(v) for k, v in figures.encode_us.items()},
                "decode_us": {k: list(v) for k, v in figures.decode_us.items()},
                "critical": critical if critical == "all" else sorted(critical),
                "norms": {str(k): v for k, v in self._norms.items()},
                "low_rank": {name: [sq, {str(r): e for r, e in rel.items()}]
                             for name, (sq, rel) in self._low_rank.items()},
                "steps": [[key, comm, step, se if math.isfinite(se) else None]
                          for key, (comm, step, se) in sorted(self._steps.items())],
                # Each table: place, name, shape, sent dense, the rows it was priced
                # with, what its rows go as.
                "tables": [[t.place, t.name, list(t.shape), t.dense, t.rows, t.tokens,
                            t.label] for t in plan.tables]}

    def restored(self, record: dict):
        """A checkpoint's record (``PlanRecord``): the next plan is made from it."""
        self._saved = record

    def _restored_figures(self, gradients):
        """The restored record's figures for these gradients and its plan's labels by
        name, when every worker restored the same ones; else (None, None) (then all
        measure). Takes the record. Every worker calls it at the same point: it
        all-gathers a checksum."""
        record, self._saved = self._saved, None
        auto = self._ops.compressor
        usable = (record is not None
                  and json.loads(json.dumps(gradients)) == record["gradients"]
                  and record["num_workers"] == self._ops.group_size
                  and record["candidates"] == [c.label for c in planner.ALL]
                  and len(record["link_us"]) == len(planner.LINK_SIZES)
                  and (auto.link_gbps or any(record["link_us"])
                       or self._ops.group_size < 2))
        figures_json = None
        if usable:
            figures_json = json.dumps({k: record.get(k) for k in
                                       ("link_us", "encode_us", "decode_us", "critical",
                                        "norms", "low_rank", "steps", "labels", "tables")},
                                      sort_keys=True)
        if not self._all_restored(figures_json):
            if record is not None:
                logging.info("tfgc: compressor='auto': the checkpoint's plan is not for "
                             "these gradients, this cluster or every worker; measuring")
            return None, None, None
        figures = planner.Figures(
            record["num_workers"], tuple(record["link_us"]),
            {label: tuple(us) for label, us in record["encode_us"].items()},
            {label: tuple(us) for label, us in record["decode_us"].items()},
            auto.link_gbps, auto.latency_ms)
        if self._sums is not None:  # regimes tracked: carry on from the saved interval
            critical = record["critical"]
            self._critical = critical if critical == "all" else frozenset(critical)
            self._norms = {int(k): v for k, v in record["norms"].items()}
            self._low_rank = {name: (sq, {_error_key(k): e for k, e in rel.items()})
                              for name, (sq, rel) in record.get("low_rank", {}).items()}
            self._steps = steps_from_record(record.get("steps", []))
        tables = record.get("tables") or []
        for place, _, _, _, rows, tokens, _ in tables:
            if self._rows.get(place, (0, 0))[0] == 0:  # not counted since: the saved count
                self._rows[place] = (rows, tokens)
        logging.info("tfgc: compressor='auto': the plan's figures restored from the "
                     "checkpoint (%s)", figures.describe())
        return figures, record.get("labels"), tables[0][6] if tables else None

    def _moved_link(self, gradients, figures):
        """The restored ``figures`` with the link measured now (every worker at once),
        where that predicts the float32 all-reduce of ``gradients``
        ``RESTORED_LINK_FACTOR`` times slower or faster than they do; then the steps
        timed on the old link are forgotten. Otherwise None. Every worker calls it at
        the same point, after agreeing on the restored figures."""
        new = planner.measure_link(self._ops, figures)
        if new is figures:  # a given link, or one worker: nothing measured
            return None
        nbytes = sum((tf.TensorShape(g[1]).num_elements() or 0) * tf.as_dtype(g[2]).size
                     for g in gradients)
        ratio = max(planner.link_ratio(figures, new, nbytes, figures.num_workers), 1e-12)
        if max(ratio, 1.0 / ratio) < RESTORED_LINK_FACTOR:
            return None
        logging.info("tfgc: compressor='auto': the link differs from the checkpoint's "
                     "(%s, was %s): planning for it afresh", new.describe_link(),
                     figures.describe_link())
        self.relinked += 1
        self._steps = {}
        return new

    def _all_restored(self, text) -> bool:
        """Whether every worker restored ``text`` (this worker's, None where it has
        nothing usable): an all-gather of its checksum. Every worker calls it at the
        same point."""
        word = 0 if text is None else zlib.crc32(text.encode()) & 0x7FFFFFFF or 1
        words = self._ops.gather_words([word])[:, 0]
        return bool(word) and len(set(words.tolist())) == 1

    def _planned(self, gradients, figures, only=None, dense=None, rows_label=None):
        """The plan of the layout ``gradients`` under ``figures`` and the current
        regimes, errors and steps (``planner.plan_tables``): the tables at the places
        ``dense`` sent dense (their rows as ``rows_label``, where given), or, with None,
        the faster choice from the rows last counted (``_count_rows``, which the
        callers gather first)."""
        critical = self._critical
        if critical == "all":
            critical = frozenset(g[0] for g in gradients)
        auto = self._ops.compressor
        low_rank = None
        if auto.budget_rank and self._low_rank:
            low_rank = planner.LowRank(auto.budget_rank, dict(self._low_rank))
        pace = planner.pace_from(list(self._steps.values()), auto.low_rank_steps)
        tables = {k: self._rows.get(p, (0, 0))
                  for p, k in enumerate(_table_places(gradients))}
        return planner.plan_tables([tuple(g[:3]) for g in gradients], tables, figures,
                                   auto.error, dense=dense, rows_label=rows_label,
                                   critical=critical, low_rank=low_rank, only=only, pace=pace)

    def _count_rows(self, gradients):
        """Every worker's rows of the last step, the most of each (``_rows``). Every
        worker calls it at the same point."""
        places = range(len(_table_places(gradients)))
        if not places or any(p not in self._counts for p in places):
            return  # no step counted them yet (the same on every worker)
        with tf.init_scope():
            words = np.concatenate([self._counts[p].numpy() for p in places])
        most = np.max(self._ops.gather_words(words.tolist()), axis=0)
        self._rows = {p: (int(most[2 * p]), int(most[2 * p + 1])) for p in places}

    def _first_floats(self, values):
        """Worker 0's ``values`` (float32, sent as the bits of words), on every worker."""
        bits = np.asarray(values, np.float32).view(np.int32)
        return self._ops.gather_words(bits)[0].astype(np.int32).view(np.float32)

    def _repriced(self, gradients, current):
        """``current`` priced with the rows the last step counted, where it has tables
        (the first plan's are not counted yet, so it priced their rows at nothing): the
        communication its timed steps are set against. Every worker calls it at the same
        point."""
        if not current.tables:
            return current
        self._count_rows(gradients)
        plan = self._as_running(gradients, self._figures[1], current)
        return current if plan is None or plan.key() != current.key() else plan

    def _as_running(self, gradients, figures, current):
        """``current``'s choice priced anew under ``figures`` and the current regimes
        and budgets, its tables as its traced step sends them (None where they rule
        that choice out)."""
        return self._planned(gradients, figures,
                             only={e.name: e.label for e in current.entries},
                             dense=current.dense_places,
                             rows_label=current.tables[0].label if current.tables else None)

    def _timed(self, plan, step_s, step_se_s):
        """Keeps worker 0's measured step and its standard error (from its words, NaN:
        none; an error not given stays NaN, which ``planner.pace_from`` reads as
        unknown) for the current plan, with the communication it predicts."""
        if plan is not None and math.isfinite(step_s) and step_s > 0:
            self._steps[plan.key()] = (plan.step_seconds(), step_s, step_se_s)

    def _check_agree(self, plan):
        """Stops with a message if any worker derived another plan (a bug, or workers
        that build different models)."""
        digests = self._ops.gather_words([plan.digest()])[:, 0]
        if len(set(digests.tolist())) > 1:
            raise ValueError(
                "tfgc: the workers' compressor='auto' plans differ (digest by replica: "
                f"{digests.tolist()}); every worker must build the same model. This "
                f"worker's plan:\n{plan.table()}")


    def track(self, tensors, variables, mask, reduced, replica_id, ok=None):
        """On worker 0 (whose figures every worker takes, ``adapt``): adds this step's
        reduced planned gradients to their interval sums, unless the step was skipped
        (``ok`` False: not finite somewhere), and, with low-rank candidates on and a
        capture asked for, keeps each matrix's local gradient for the next measurement.
        Every worker notes which gradients are matrices. In the traced step, replica 0.

        The other workers keep nothing: on a cluster of few cores the sums alone cost
        the step about a fifth (the wide MLP, 4 workers on 2 cores: 114 against 147 ms).
        """
        if self._sums is None or replica_id != 0:
            return
        # By place in the layout.
        planned = dict(zip(self._planned_places(), [
            (t, v, r) for t, v, m, r in zip(tensors, variables, mask, reduced) if m]))
        if self._ops.compressor.budget_rank > 0:
            self._matrices = [j for j, (t, _, _) in planned.items()
                              if planner.LOW_RANK[0].described.supports(t.shape, t.dtype)]
        if self._ops.worker_rank != 0:
            return
        with tf.init_scope(), tf.device(self._ops.local_devices[0]):
            for j, (t, _, _) in planned.items():
                if j not in self._sums:
                    self._sums[j] = state_lib.local_variable(tf.zeros(t.shape, t.dtype),
                                                             "tfgc_interval_sum")
            for j in self._matrices:
                if j not in self._last:
                    self._last[j] = state_lib.local_variable(
                        tf.zeros(planned[j][0].shape, planned[j][0].dtype),
                        "tfgc_last_gradient")
            if self._matrices and self._capture is None:
                self._capture = state_lib.local_variable(tf.constant(True), "tfgc_capture")
        if ok is None:  # nothing compressed: no step decision, so look at the values
            ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(r))
                                for _, _, r in planned.values()])

        def add():
            for j, (_, _, r) in planned.items():
                self._sums[j].assign_add(r)
            return tf.constant(True)

        tf.cond(ok, add, lambda: tf.constant(False))
        for j in self._matrices:
            self._last_vars[j] = planned[j][1]
        if self._matrices:
            def keep():
                for j in self._matrices:
                    self._last[j].assign(planned[j][0])
                return tf.constant(True)

            tf.cond(self._capture.read_value(), keep, lambda: tf.constant(False))

    def _planned_places(self):
        """The places in the layout of the current plan's entries, in order."""
        layout, plan = self._plan[1], self._plan[2]
        dense = plan.dense_places
        tables = {k: p for p, k in enumerate(_table_places(layout))}
        return [k for k in range(len(layout)) if k not in tables or tables[k] in dense]

    def track_tables(self, slices, variables, reduced, ok, replica_id):
        """Each embedding table's rows this step (``slices``, IndexedSlices, by place
        among the tables; ``reduced``: the summed rows of those the plan does not send
        dense, None for the others; ``ok``: the step's decision, or None). Counted on
        every worker (``_count_rows``); on worker 0, with regimes tracked, the summed
        rows added to the table's interval sum (a table has its regime as rows too, so
        a switch to dense finds its previous norm), and, with low-rank candidates on,
        the local rows kept densified when a capture is asked for, so that the low-rank
        measurement prices the table dense too. In the traced step, replica 0."""
        if replica_id != 0 or self.plan is None:
            return
        with tf.init_scope(), tf.device(self._ops.local_devices[0]):
            for p in range(len(slices)):
                if p not in self._counts:
                    self._counts[p] = state_lib.local_variable(tf.zeros([2], tf.int32),
                                                               "tfgc_table_rows")
        for p, s in enumerate(slices):
            unique, _ = tf.unique(tf.reshape(s.indices, [-1]))
            self._counts[p].assign(tf.stack([tf.size(unique, tf.int32),
                                             tf.size(s.indices, tf.int32)]))
        if self._sums is None:
            return
        places = _table_places(self._plan[1])
        rows = [(places[p], s, v, r)
                for p, (s, v, r) in enumerate(zip(slices, variables, reduced)) if r is not None]
        low_rank = planner.LOW_RANK[0].described
        captured = [(k, s, v) for k, s, v, _ in rows if self._ops.compressor.budget_rank > 0
                    and low_rank.supports(tf.TensorShape(v.shape), s.values.dtype)]
        self._row_matrices = [k for k, _, _ in captured]
        if self._ops.worker_rank != 0 or not rows:
            return
        with tf.init_scope(), tf.device(self._ops.local_devices[0]):
            for k, s, v, _ in rows:
                if k not in self._sums:
                    self._sums[k] = state_lib.local_variable(
                        tf.zeros(v.shape, s.values.dtype), "tfgc_interval_sum")
            for k, s, v in captured:
                if k not in self._last:
                    self._last[k] = state_lib.local_variable(
                        tf.zeros(v.shape, s.values.dtype), "tfgc_last_gradient")
            if captured and self._capture is None:
                self._capture = state_lib.local_variable(tf.constant(True), "tfgc_capture")
        if ok is None:
            ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(r.values))
                                for _, _, _, r in rows])

        def add():
            for k, _, v, r in rows:
                self._sums[k].scatter_add(tf.IndexedSlices(
                    tf.reshape(r.values, [-1] + tf.TensorShape(v.shape)[1:].as_list()),
                    r.indices))
            return tf.constant(True)

        tf.cond(ok, add, lambda: tf.constant(False))
        if captured:
            def keep():
                for k, s, v in captured:
                    self._last[k].assign(embeddings.densify(s, v))
                return tf.constant(True)

            tf.cond(self._capture.read_value(), keep, lambda: tf.constant(False))

    def capture(self):
        """See ``CompressedAllReduce.capture_gradients``."""
        if self._capture is not None:
            self._capture.assign(True)

    def _measure_low_rank(self, gradients):
        """Worker 0's measured errors of every kept matrix (``planner.low_rank_errors``
        and ``planner.top_k_errors`` of its last local gradient plus its residual, where
        it has one), agreed: every worker gets the same numbers. Eager; every worker
        calls it at the same point."""
        places = list(self._matrices) + [k for k in self._row_matrices
                                         if k not in self._matrices]
        if not places:
            return {}
        sparse = [(c.label, c.described.inner.ratio) for c in planner.SPARSE]
        width = 1 + len(planner.RANKS) + len(sparse)
        values = np.zeros([len(places), width], np.float32)
        if self._ops.worker_rank == 0:
            residuals = self._residuals()
            for row, j in enumerate(places):
                x = self._last[j].numpy()
                residual = residuals.get(j) if j in self._matrices else None
                if residual is not None and residual.shape == x.shape:
                    x = x + residual
                shape = planner.LOW_RANK[0].described.matrix_shape(tf.TensorShape(x.shape))
                sq, rel = planner.low_rank_errors(x.reshape(shape), planner.RANKS, seed=j)
                _, kept = planner.top_k_errors(x, [ratio for _, ratio in sparse])
                if rel:  # else (a step that was not finite) left out, as zeros are
                    values[row] = ([sq] + [rel[r] for r in planner.RANKS]
                                   + [kept[ratio] for _, ratio in sparse])
        bits = values.reshape(-1).view(np.int32)
        agreed = self._ops.gather_words(bits)[0].astype(np.int32).view(np.float32)
        agreed = agreed.reshape(len(places), width)
        # A matrix without a squared norm was not measured (not finite): no low rank.
        keys = list(planner.RANKS) + [label for label, _ in sparse]
        return {gradients[j][0]: (float(agreed[row, 0]),
                                  {key: float(agreed[row, 1 + k]) for k, key in enumerate(keys)})
                for row, j in enumerate(places) if agreed[row, 0] > 0}

    def _residuals(self):
        """By place, the error-feedback residual the live state holds for the kept
        matrices' variables (replica 0), as arrays."""
        out = {}
        for state in self._ops.states():
            for j, var in self._last_vars.items():
                if j in out or not state.has_slot(var):
                    continue
                slot = state.slot(var, 0)
                if isinstance(slot, dict) and "residual" in slot:
                    out[j] = slot["residual"].numpy()
        return out

    # -- between steps -----------------------------------------------------------------

    def _adopt(self, gradients, figures, plan):
        """``plan`` from the next step on: a new generation (new train functions), which
        finds the plan and the figures ready."""
        self._new_generation()
        generation = self._ops.generation
        self._figures = (generation, figures)
        self._plan = (generation, gradients, plan)
        logging.info("%s", plan.table())

    def replan(self, margin: float, due=None) -> bool:
        """See ``CompressedAllReduce.replan``."""
        check_number("margin", margin, 0)
        if due is not None and not self._ops.gather_words([int(bool(due))])[0][0]:
            return False
        current = self.plan
        if current is None:
            return False
        gradients, old = self._plan[1], self._figures[1]
        new = planner.measure_link(self._ops, old)
        if not planner.link_changed(old, new, current, margin):
            return False
        logging.info("tfgc: compressor='auto': the link changed (%s, was %s)",
                     new.describe(), old.describe())
        self._count_rows(gradients)
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
        self._start_regimes()
        if self.plan is not None:
            gradients, figures = self._plan[1], self._figures[1]
            self._count_rows(gradients)
            self._adopt(gradients, figures, self._planned(gradients, figures))

    def adapt(self, threshold: float, min_gain_s: float = 0.0, step_s=None,
              step_se_s=None) -> frozenset:
        """See ``CompressedAllReduce.adapt``."""
        check_number("threshold", threshold, 0, strict=True)
        check_number("min_gain_s", min_gain_s, 0)
        _check_step(step_s, step_se_s)
        current = self.plan
        if self._sums is None:
            raise ValueError("adapt() needs track_regimes() and a step under "
                             "compressor='auto' first")
        if current is None:
            # No plan in this generation: the policy sends every gradient dense (a small
            # model), or no step has run since. Nothing is in a regime.
            return frozenset()
        gradients = self._plan[1]
        with tf.init_scope():
            norms = [float(tf.norm(self._sums[j])) if j in self._sums else float("nan")
                     for j in range(len(gradients))]
            for total in self._sums.values():
                total.assign(tf.zeros_like(total))
        # Worker 0's norms, least gain, step and its error (as the bits of float32
        # words), so every worker decides alike.
        first = self._first_floats(norms + [min_gain_s, _or_nan(step_s), _or_nan(step_se_s)])
        min_gain_s = float(first[-3])
        self._timed(self._repriced(gradients, current), float(first[-2]), float(first[-1]))
        now = {j: float(v) for j, v in enumerate(first[:-3])}
        critical = frozenset(gradients[j][0] for j in
                             planner.critical_layers(self._norms, now, threshold))
        self._norms = now
        self._critical = critical
        if self._ops.compressor.budget_rank:
            self._measured(gradients)
        # Planned again every time: the regimes, the low-rank errors or the steps timed
        # (the pace) may have moved, and a new plan is taken only where it pays.
        self._plan_again(gradients, current, min_gain_s)
        return critical

    def measure_low_rank(self, step_s=None, step_se_s=None) -> bool:
        """See ``CompressedAllReduce.measure_low_rank``."""
        _check_step(step_s, step_se_s)
        current = self.plan
        if self._sums is None or current is None or not self._ops.compressor.budget_rank:
            return False
        gradients = self._plan[1]
        self._timed(self._repriced(gradients, current), *(float(v) for v in self._first_floats(
            [_or_nan(step_s), _or_nan(step_se_s)])))
        if not self._measured(gradients):
            return False
        return self._plan_again(gradients, current)

    def _measured(self, gradients) -> bool:
        """Measures the low-rank errors again (and, the first time, the low-rank
        candidates' CPU cost); whether they changed."""
        figures = planner.measure_low_rank(self._ops, self._figures[1])
        if figures is not self._figures[1]:
            logging.info("tfgc: compressor='auto' measured the low-rank candidates: %s",
                         figures.describe())
            self._figures = (self._figures[0], figures)
        with tf.init_scope():
            low_rank = self._measure_low_rank(gradients)
            if self._capture is not None:
                self._capture.assign(False)  # until the next ``capture``
        changed = low_rank != self._low_rank
        self._low_rank = low_rank
        return changed

    def _plan_again(self, gradients, current, min_gain_s: float = 0.0) -> bool:
        """Plans from the current figures, regimes and errors, and adopts a plan that
        differs, unless the current one still keeps within the regimes and budgets and
        the new one is predicted to save less than ``min_gain_s`` a step, under the
        pace and the paces its measured slope allows (``planner.change_pays``): a change
        retraces the train function, which costs seconds, and a new rank that saves a
        tenth of a millisecond does not pay that back, nor does one that only the
        steps' noise favours. Its callers have counted the tables' rows."""
        figures = self._figures[1]
        plan = self._planned(gradients, figures)
        if plan.key() != current.key():
            kept = None
            if min_gain_s > 0 or (plan.pace is not None and plan.pace.measured_slope):
                kept = self._as_running(gradients, figures, current)
            if planner.change_pays(kept, plan, min_gain_s):
                self._adopt(gradients, figures, plan)
                return True
            logging.info("tfgc: compressor='auto' keeps its plan: the new one would save "
                         "%.3f ms a step at the measured pace and %.3f ms at the least the "
                         "steps allow, less than a change costs (%.3f ms a step over the "
                         "steps it would run)",
                         (kept.paced_seconds() - plan.paced_seconds()) * 1e3,
                         planner.least_gain(kept, plan) * 1e3, min_gain_s * 1e3)
            plan = kept
        self._plan = (self._plan[0], gradients, plan)
        return False

    @property
    def norms(self):
        """The last interval's norms, by place in the plan's layout (the planned
        gradients and the embedding tables, in order)."""
        return dict(self._norms)

    @property
    def figures(self):
        """The current figures (``planner.Figures``), or None before the first plan."""
        return None if self._figures is None else self._figures[1]


def _traced(variables):
    """The tables' (name, shape) as the plan's ``Table`` lines name them."""
    return [(base.name_of(v), tuple(tf.TensorShape(v.shape).as_list())) for v in variables]


def _table_places(layout):
    """The indices of the embedding tables in a plan's layout (``plan_for``)."""
    return [k for k, g in enumerate(layout) if len(g) > 3]


def _tables_of(layout):
    return [tuple(g) for g in layout if len(g) > 3]


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


def _or_nan(step_s):
    """A measured step as a word carries it: NaN for none."""
    return float("nan") if step_s is None else step_s


def _error_key(key: str):
    """A measured error's key as a record keeps it (a string) back as
    ``planner.Candidate.error_key`` has it: a rank, or top-k's label."""
    return int(key) if key.isdigit() else key
