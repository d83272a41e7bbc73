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
"""

import time

import numpy as np
import tensorflow as tf
from absl import logging

from tfgc.compressors.base import check_number
from tfgc.distribute import planner
from tfgc.distribute import state as state_lib
from tfgc.distribute.paths import base


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

    def plan_for(self, tensors, variables, mask):
        """The plan of the gradients in ``mask``: made (measuring first) at the first
        trace of a generation, then kept for the same gradients."""
        gradients = tuple((base.name_of(v), tuple(t.shape.as_list()), t.dtype.name)
                          for t, v, m in zip(tensors, variables, mask) if m)
        if self._plan is not None and self._plan[:2] == (self._ops.generation, gradients):
            return self._plan[2]
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is not None and len(self._ops.local_devices) > 1:
            # Replica threads take turns; the measurements run once, in the merge.
            replica_ctx.merge_call(lambda _: self._make(gradients))
        else:
            self._make(gradients)
        return self._plan[2]

    def _make(self, gradients):
        generation = self._ops.generation
        if self._plan is not None and self._plan[:2] == (generation, gradients):
            return
        auto = self._ops.compressor
        if self._figures is None or self._figures[0] != generation:
            started = time.perf_counter()
            figures = planner.measure(self._ops, auto.link_gbps, auto.latency_ms)
            logging.info("tfgc: compressor='auto' measured in %.1f s: %s",
                         time.perf_counter() - started, figures.describe())
            self._figures = (generation, figures)
        plan = self._planned(gradients, self._figures[1])
        self._check_agree(plan)
        self._plan = (generation, gradients, plan)
        logging.info("%s", plan.table())

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
