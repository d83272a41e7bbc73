"""Callbacks that put compression statistics into Keras logs, the progress bar and TensorBoard."""

import collections
import math
import os
import time
from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf
import tf_keras as keras
from absl import logging

from tfgc.compressors import serialize_config
from tfgc.compressors.base import check_int, check_number
from tfgc.distribute import planner
from tfgc.distribute import state as state_lib
from tfgc.distribute.state import flatten_fields


class CompressionStatsCallback(keras.callbacks.Callback):
    """Adds this worker's communication figures to the logs of every batch and epoch.

    Keys (so ``model.fit`` prints them and ``History`` records them):

    * ``sent_MB``: megabytes (1e6) this worker put on the wire for the last gradient
      reduction (the ring all-reduce or all-gather of its payloads);
    * ``dense_sent_MB``: what the stock dense ring all-reduce sends for the same
      gradients on the same number of workers;
    * ``ratio``: compression of the payload (dense gradients / payload);
    * ``wire_ratio``: dense_sent_MB / sent_MB.

    ``strategy.compression_stats()`` has the rest (received bytes, payload bytes,
    totals, steps skipped for non-finite gradients).

    The callback reads three variables per batch; pass ``every_n_batches`` to read
    less often. The progress bar averages nothing: it shows the last step's figures.

    TensorBoard: with ``log_dir``, the callback also writes scalar summaries to
    ``log_dir/worker<i>``, ``i`` this worker's index in the cluster (0 for a single
    worker), so TensorBoard shows the workers as runs side by side. Tags (each
    behind ``prefix``):

    * ``compression/<field>`` for every figure of ``strategy.compression_stats()``:
      ``sent_bytes``, ``received_bytes``, ``payload_bytes``, ``dense_bytes``,
      ``dense_sent_bytes`` (the last reduction), their ``total_*`` since the
      strategy was built, ``ratio``, ``wire_ratio``, ``steps`` and
      ``nonfinite_steps``;
    * ``residual_norm/<variable>``: the l2 norm of the error-feedback residual
      (the state field ``residual``) of each compressed variable, named without
      its ``:0``; other residual fields (the reduce-scatter's
      ``server_residual``) get ``residual_norm/<variable>/<field>``;
    * ``compressor/<name>`` and ``compressor/<name>/<variable>``: what the
      compressor's ``diagnostics`` reports for itself and per gradient (DGC's
      warm-up density and velocity norms, GradiVeQ's d, ...);
    * ``compression/plan`` (text, under ``compressor="auto"``): the plan's table, at
      the first write after each new plan.

    Residuals and diagnostics are this worker's first local replica's, read from
    the state that the model's optimizer owns. Values are stored as float32 (as
    TensorBoard's scalars are): byte counts above 2**24 are rounded.

    Args:
      strategy: a ``tfgc.CompressedMultiWorkerMirroredStrategy``.
      every_n_batches: read the figures for the logs every this many batches.
      prefix: put before every log key and summary tag.
      log_dir: a directory (str or path) for the summaries; None (the default)
        writes none.
      update_freq: when to write them: ``"epoch"`` (at the end of every epoch,
        the epoch as step) or an integer n >= 1 (every n training batches, the
        optimizer's iteration count as step; ``"batch"`` is 1), as
        ``keras.callbacks.TensorBoard``.
    """

    def __init__(self, strategy, every_n_batches: int = 1, prefix: str = "",
                 log_dir=None, update_freq="epoch"):
        super().__init__()
        if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) \
                or every_n_batches < 1:
            raise ValueError(f"`every_n_batches` must be an integer >= 1, got {every_n_batches!r}")
        if not hasattr(strategy, "compression_stats"):
            raise ValueError("`strategy` must be a tfgc.CompressedMultiWorkerMirroredStrategy, "
                             f"got {type(strategy).__name__}")
        if log_dir is not None:
            if not isinstance(log_dir, (str, os.PathLike)) or isinstance(log_dir, bytes):
                raise ValueError("`log_dir` must be a directory path (a str or os.PathLike) or "
                                 f"None, got {type(log_dir).__name__} {log_dir!r}")
            log_dir = os.fspath(log_dir)
            if not isinstance(log_dir, str) or not log_dir:
                raise ValueError(f"`log_dir` must be a non-empty directory path, got {log_dir!r}")
        if isinstance(update_freq, str) and update_freq == "batch":
            update_freq = 1
        if not (isinstance(update_freq, str) and update_freq == "epoch") and (
                isinstance(update_freq, bool) or not isinstance(update_freq, int)
                or update_freq < 1):
            raise ValueError("`update_freq` must be \"epoch\", \"batch\" or an integer number "
                             f"of batches >= 1, got {update_freq!r}")
        self._strategy = strategy
        self._every = every_n_batches
        self._prefix = prefix
        self._last = None
        self._log_dir = log_dir
        self._update_freq = update_freq
        self._per_batch = update_freq != "epoch"
        self._writer = None
        self._epoch_start_step = 0
        self._next_write = 0
        self._plan_written = None

    # -- Keras logs -------------------------------------------------------------------

    def _figures(self):
        stats = self._strategy.compression_stats()
        p = self._prefix
        return {f"{p}sent_MB": stats["sent_bytes"] / 1e6,
                f"{p}dense_sent_MB": stats["dense_sent_bytes"] / 1e6,
                f"{p}ratio": stats["ratio"],
                f"{p}wire_ratio": stats["wire_ratio"]}

    def on_train_batch_end(self, batch, logs=None):
        if self._log_dir is not None and self._per_batch:
            step = self._epoch_start_step + batch + 1
            if step >= self._next_write:
                self._write(step)
                self._next_write = (step // self._update_freq + 1) * self._update_freq
        if logs is None:
            return
        if self._last is None or batch % self._every == 0:
            self._last = self._figures()
        logs.update(self._last)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            self._last = self._figures()
            logs.update(self._last)
        if self._log_dir is not None:
            if not self._per_batch:
                self._write(epoch)
            if self._writer is not None:
                self._writer.flush()

    # -- TensorBoard ------------------------------------------------------------------

    @property
    def log_dir(self):
        """This worker's run directory (``log_dir/worker<i>``), or None without ``log_dir``."""
        if self._log_dir is None:
            return None
        return os.path.join(self._log_dir, f"worker{self._worker_index()}")

    def _worker_index(self) -> int:
        # The strategy's index counts a chief task apart from the workers (the
        # resolver's task id is 0 for both the chief and worker 0).
        index = getattr(self._strategy, "worker_index", None)
        if isinstance(index, int):
            return index
        resolver = getattr(self._strategy, "cluster_resolver", None)
        task_id = getattr(resolver, "task_id", None)
        return int(task_id) if task_id is not None else 0

    def _iterations(self) -> int:
        optimizer = getattr(self.model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None)
        return int(iterations.numpy()) if iterations is not None else 0

    def on_train_begin(self, logs=None):
        if self._log_dir is None:
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        if self._per_batch:
            step = self._iterations()
            self._next_write = (step // self._update_freq + 1) * self._update_freq

    def on_epoch_begin(self, epoch, logs=None):
        if self._log_dir is not None and self._per_batch:
            # One read per epoch; batches count on from here.
            self._epoch_start_step = self._iterations()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _state(self):
        """The compression state of the model's optimizer (or of its inner one), or None."""
        optimizer = getattr(self.model, "optimizer", None)
        for owner in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if owner is None:
                continue
            state = self._strategy.compression_state(owner)
            if state is not None:
                return state
        return None

    def _variable_names(self, variables) -> List[str]:
        names, seen = [], {}
        for var in variables:
            # A Keras 3 variable's name is its own ("kernel"), its path the layer's too.
            name = getattr(var, "path", None) or var.name
            name = name[:-2] if name.endswith(":0") else name
            count = seen.get(name, 0)
            seen[name] = count + 1
            names.append(name if not count else f"{name}_{count}")
        return names

    def scalars(self) -> Dict[str, float]:
        """The summary values, by tag (without ``prefix``), as the next write would record them."""
        out = {f"compression/{field}": float(value)
               for field, value in sorted(self._strategy.compression_stats().items())}
        state = self._state() if self.model is not None else None
        if state is None:
            return out
        compressor = self._strategy.compressor
        step = state.step(0).read_value()
        # The state's layout is the current compressor's only once a step has run with
        # it (a switch migrates the state at the next trace).
        same = state.compressor_key == repr(serialize_config(compressor))
        if same:
            for key, value in compressor.diagnostics(None, step).items():
                out[f"compressor/{key}"] = float(np.asarray(value))
        # Gradients sent dense under a compressor that applies momentum keep a
        # momentum buffer only: no residual, not the compressor's layout.
        momentum_only = getattr(state, "_dense", ())
        variables = self.model.trainable_variables
        for var, name in zip(variables, self._variable_names(variables)):
            if not state.has_slot(var):
                continue
            slot = state.slot(var, 0)
            for path, field in self._residual_fields(slot):
                tag = f"residual_norm/{name}" if path == "residual" \
                    else f"residual_norm/{name}/{path}"
                out[tag] = float(tf.norm(tf.cast(field, tf.float64)))
            if same and state_lib.var_key(var) not in momentum_only:
                for key, value in compressor.diagnostics(slot, step).items():
                    out[f"compressor/{key}/{name}"] = float(np.asarray(value))
        return out

    @staticmethod
    def _residual_fields(slot) -> List[Tuple[str, object]]:
        if not isinstance(slot, dict):
            return []
        return [(path, leaf) for path, leaf in flatten_fields(slot)
                if path.rsplit("/", 1)[-1].endswith("residual") and leaf.dtype.is_floating]

    def _write(self, step: int):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        values = self.scalars()
        # compressor="auto": its plans (one per set of gradients the step reduces: a
        # GAN's two), as text, when they are new.
        plans_of = getattr(self._strategy, "compression_plans", None)
        plans = plans_of() if plans_of is not None else []
        digests = [plan.digest() for plan in plans]
        with self._writer.as_default(step=int(step)):
            for tag, value in values.items():
                tf.summary.write(f"{self._prefix}{tag}", tf.constant(value, tf.float32),
                                 metadata=_SCALAR_METADATA)
            if plans and digests != self._plan_written:
                text = "\n\n".join(plan.table() for plan in plans)
                tf.summary.write(f"{self._prefix}compression/plan", tf.constant(text),
                                 metadata=_TEXT_METADATA)
                self._plan_written = digests


class AutoPlanCallback(keras.callbacks.Callback):
    """Keeps ``compressor="auto"``'s plan fitted to the link and to the phase of training.

    When training starts, every planned gradient is in a critical regime (ACCORDION,
    Agarwal et al., MLSys 2021: early training is where small gradient errors cost
    accuracy for good), so it is sent with no more error than bf16's. At the end of
    every interval (``every_epochs`` epochs, or ``every_steps`` steps) the callback

    * ends an interval (``CompressedAllReduce.adapt``): a gradient stays critical when
      the norm of its mean over the interval changed by ``threshold`` or more since the
      previous interval, and by more than ``noise`` times what the two intervals' noise
      could move it (estimated from each step's squared norm:
      ``planner.critical_layers``), and leaves that regime (back to the budget's plan)
      otherwise;
      and every gradient is critical for the next interval, and goes no lossier than
      it went, where the rate the optimizer gives its next step fell by ``threshold``
      or more since the previous interval's end (ACCORDION's rule at a decay, which
      its code applies at any fall: here a cosine schedule's last few intervals, a
      step decay's, not a slow exponential decay's);
    * measures the link again (``CompressedAllReduce.replan``) and plans again when the
      float32 all-reduce it predicts moved by more than ``link_margin``. A measurement
      takes the link for a moment (a third of a second at 100 Mbit/s), so it is made
      only once the time since the last one is long enough for it to cost at most
      ``link_share`` of training (worker 0's clock decides for all).

    With regimes on, it also measures each matrix's low-rank error once the first plan's
    steps have been timed (``LOW_RANK_AFTER`` steps, after the first step, which
    traces, and ``SETTLE_STEPS`` more, which still warm up) and at every interval's end
    (``Auto.budget_rank``, its ``low_rank`` argument: the low-rank candidates'
    budget), so that low rank can be planned from the fifth step on (while critical,
    at ``Auto.critical_rank`` or more, by default twice the budget's rank, and within
    ``Auto.critical_error``). Each time it passes the current plan's measured
    step (the median of its settled steps, the least of them while fewer than three)
    and that step's standard error, from which the planner weighs the steps a
    low-rank plan adds against the time it saves (``Auto.low_rank_steps``), and takes
    a change only where it pays for every slope the steps' noise allows, or as a trial
    that its steps may send back (``planner.change_pays``), where what it saves over
    the fit at the fitted pace covers its change, the change back and what it would
    lose, at the slowest pace the steps allow, over the steps up to the next
    interval's end, which it runs before its steps are weighed. It passes the
    steps left of the fit as well: the first measurement times the low-rank and top-k
    codecs (seconds, on a machine whose cache lacks them) only where what the matrices
    cost a step could, over those steps, pay for it (``planner.timing_pays``).

    A new plan takes effect at the next step (a new train function, as a compressor
    switch). That step's retrace costs seconds, so the callback times it and the steps
    that settle after it (their durations beyond the median of the ordinary steps,
    ``change_s``) and, at the low-rank measurement and intervals' ends, asks a new plan
    to save at least that much over the rest of the fit (or over an interval, where the
    fit's length is unknown) before it is taken (``min_gain_s`` of
    ``CompressedAllReduce.adapt``; twice that while the steps have not measured the
    pace's slope: ``planner.required_gain``). Until a change has been timed, the fit's
    first step stands for it: its excess over the ordinary steps, less what the
    planner measured in it (``CompressedAllReduce.measuring_s``), is a trace's cost
    (and where an interval ends before an ordinary step is timed, its whole seconds).
    What the callback's own work took is in ``measure_s`` (the low-rank timings) and
    ``costs`` (per interval's end), and what the fit's changes of plan cost in
    ``retraces`` (each timed one's seconds). Where those are ``RETRACE_SHARE`` of the
    fit or more over two changes or more, it warns at the fit's end: a retrace of a
    large model takes seconds (EfficientNetB0 on 2 cores: 11-17 s), and where the
    regimes move at every interval's end (a short interval sums few gradients, whose
    norms move more), so does the plan. Adds ``auto_critical`` (how many gradients are
    critical) and ``auto_replanned`` (1 if the link changed the plan) to the epoch's
    logs. Every worker must run it (Keras calls every worker's callbacks at the same
    point).

    Args:
      strategy: a ``tfgc.CompressedMultiWorkerMirroredStrategy`` with
        ``compressor="auto"``.
      threshold: ACCORDION's relative change of the norm (0.5, as in its paper's code);
        None: no regimes, the budget's plan throughout.
      watch_learning_rate: whether a fall of the learning rate by ``threshold`` makes
        every gradient critical (the model's ``optimizer``, the rate its next step
        takes; a model without one has only the norms' test; with ``threshold`` None,
        neither test runs, and above 1 no fall reaches it). The rate is read at the
        interval's end: one that a callback sets when the next epoch begins
        (``LearningRateScheduler``) is seen an interval later, and one set at an
        epoch's end (``ReduceLROnPlateau``) in time where that callback comes first in
        the list.
      noise: how many times the two intervals' noise a norm must move beyond to count
        (``planner.critical_layers``; 1: a move larger than the noise's norm could
        make, or, where the noise could hide a move of ``threshold``, a move of the
        steps' spread by ``threshold``; 0: ACCORDION's bare test). Over a short interval
        the mean of a stochastic gradient is mostly noise, and the bare norm moves with
        its draw (the trainer's CNN on Fashion-MNIST at 25-step intervals, three seeds:
        the bare test called some layer critical at 11-14 of 31 interval ends, this one
        at 3-5: early training, the learning rate's decay and, twice in three seeds,
        one layer elsewhere; the MLP: 6-10 against 3;
        ``benchmarks/regimes.py``). The noise is estimated as if steps were
        independent; the steps of SGD with momentum are not (the mean's norm below the
        noise so estimated in 83-94 % of those intervals), so the test errs toward
        calling fewer gradients critical, and a decay of the learning rate it misses
        is left to ``watch_learning_rate``.
      link_margin: the relative change of the link that plans again; None: the link is
        measured once.
      link_share: the share of training time the link's measurements may take.
      every_epochs: the interval, in epochs.
      every_steps: the interval in training steps instead (None: ``every_epochs``), for
        runs of a few epochs, where the first two intervals in bf16 would otherwise be
        most of training. ACCORDION's paper tests every 10 epochs of 300 or so; a short
        interval sums fewer gradients, so its means carry more noise (``noise``).
        Under tf-keras's ``steps_per_execution``, steps are counted as such and timed
        as each call's time over its steps; the counts below (``LOW_RANK_AFTER``,
        ``SETTLE_STEPS``, ``SPREAD_FROM``) are of calls.
    """

    # Ordinary steps of the first plan timed before the low-rank errors are first measured.
    LOW_RANK_AFTER = 2
    # Steps after a trace or retrace that are not timed as the plan's: they still warm up
    # (4 workers on 2 cores, the CNN: the second step of a fit 5-25 % over later ones;
    # ResNet-50: the step after a retrace 3x an ordinary one). Their excess after a
    # retrace counts in what the change cost.
    SETTLE_STEPS = 1
    # A plan's steps that measure their own spread (``_plan_step``); fewer borrow the
    # recent steps', and while those are fewer too, the spread is at least
    # ``SPREAD_PRIOR`` of the step (``planner.PACE_PRIOR``, from the stored runs).
    SPREAD_FROM = 8
    SPREAD_PRIOR = planner.PACE_PRIOR
    # The share of a fit's seconds that its timed changes of plan may take before the
    # callback warns at the fit's end.
    RETRACE_SHARE = 0.2

    def __init__(self, strategy, threshold=0.5, link_margin=0.25, every_epochs: int = 1,
                 every_steps=None, link_share: float = 0.02, watch_learning_rate: bool = True,
                 noise: float = 1.0):
        super().__init__()
        if not hasattr(strategy, "compression_plan"):
            raise ValueError("`strategy` must be a tfgc.CompressedMultiWorkerMirroredStrategy, "
                             f"got {type(strategy).__name__}")
        if not getattr(strategy.compressor, "plans_per_tensor", False):
            raise ValueError("AutoPlanCallback needs compressor='auto', the strategy has "
                             f"{strategy.compressor!r}")
        if threshold is not None:
            check_number("threshold", threshold, 0, strict=True, also=" or None")
        check_number("noise", noise, 0)
        if link_margin is not None:
            check_number("link_margin", link_margin, 0, also=" or None")
        every_epochs = check_int("every_epochs", every_epochs, 1)
        check_number("link_share", link_share, 0, strict=True)
        if link_share > 1:
            raise ValueError(f"`link_share` must be at most 1, got {link_share!r}")
        if every_steps is not None:
            every_steps = check_int("every_steps", every_steps, 1)
        if not isinstance(watch_learning_rate, (bool, np.bool_)):
            raise ValueError("`watch_learning_rate` must be True or False, got "
                             f"{watch_learning_rate!r}")
        self._strategy = strategy
        self._watch_rate = bool(watch_learning_rate)
        self._rate_unread = False  # whether a failed read of the rate was said
        self._threshold = threshold
        self._noise = noise
        self._margin = link_margin
        self._link_share = link_share
        # The last measurement of the link: its seconds, and when it ended.
        self._probe_s, self._probed_at = 0.0, None
        self._every = every_epochs
        self._every_steps = every_steps
        self._steps = 0
        self._fit_steps = 0  # steps of the current fit
        self._epoch = 0
        self._first_epoch = None  # the current fit's first epoch
        # The current fit's first step within its first epoch: after a restore from a
        # mid-epoch backup (BackupAndRestore's ``save_freq`` in batches) Keras goes on
        # at that step, and the steps before it are not left to run.
        self._first_step = None
        self._measured = False
        # Recent steps' seconds, and what the last change of plan cost (``_time_step``).
        self._durations = collections.deque(maxlen=64)
        # The last ordinary steps' seconds since the plan changed.
        self._plan_steps = collections.deque(maxlen=256)
        self._began = None
        # The first step of the call now running, and how many steps a call ran last.
        self._first_batch, self._per_call = None, 1
        self.change_s = 0.0
        # Whether ``change_s`` is a change of plan's yet, rather than a fit's first
        # trace's; and the planner's measuring seconds when the fit began.
        self._change_timed = False
        self._measuring_from = 0.0
        self._restart_timing(None)
        # (epoch, critical names, whether the link changed the plan) per interval.
        self.history = []
        # What the callback itself spent (``costs``): seconds of the low-rank
        # candidates' first measurement, and per interval's end the seconds of ``adapt``
        # and of ``replan``, whether this worker asked for the link's measurement, and
        # whether a new plan came of them.
        self.measure_s = 0.0
        self.costs = []
        # The seconds each change of plan of the fit cost, as timed (``_time_step``).
        self.retraces = []
        self._fit_began = None

    def _restart_timing(self, generation):
        """A fit begins: its first step traces, and no change is pending."""
        self._generation = generation
        self._traced = False
        self._after_change = False
        # The retrace's step and those settling after it: (seconds a step, steps); and
        # whether that retrace is a fit's first trace.
        self._change_steps = None
        self._first_trace = False
        self._settling = 0  # steps after a trace still to settle before timing the plan
        self._plan_steps = collections.deque(maxlen=256)

    def on_train_begin(self, logs=None):
        self._measured = False
        self._fit_steps = 0
        self.retraces = []
        self._fit_began = time.perf_counter()
        self._first_epoch = self._first_step = None
        cdo = self._strategy.cross_device_ops
        if self._threshold is not None:
            cdo.track_regimes()  # a plan made before retraces: at the first step
        self._restart_timing(cdo.generation)
        self._measuring_from = cdo.measuring_s

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._first_epoch is None:
            self._first_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._began = time.perf_counter()
        self._first_batch = batch
        if self._first_step is None:
            self._first_step = batch
        if self._threshold is None:
            return
        # The call before an interval's end keeps the gradients its measurement reads.
        if self._ends_interval(batch, self._call_ends(batch)) is not False:
            self._strategy.cross_device_ops.capture_gradients()

    def _call_ends(self, batch):
        """The last step the call starting at ``batch`` runs: the model's
        ``steps_per_execution`` steps (tf-keras keeps it in a variable; else as many
        as the last call ran), fewer at the epoch's end."""
        per_call = getattr(self.model, "_steps_per_execution", None)
        try:
            per_call = max(int(per_call.numpy() if hasattr(per_call, "numpy") else per_call), 1)
        except (TypeError, ValueError):
            per_call = self._per_call
        steps = (self.params or {}).get("steps")
        last = batch + per_call - 1
        return min(last, steps - 1) if steps else last

    def _ends_interval(self, first, last):
        """Whether the steps ``first`` to ``last`` of the epoch (one call of the train
        function: more than one under ``steps_per_execution``) end an interval (None:
        unknown, an epoch whose length Keras does not know)."""
        if self._every_steps is not None:
            done = self._steps + last - first + 1
            return done // self._every_steps > self._steps // self._every_steps
        steps = (self.params or {}).get("steps")
        if steps is None:
            return None
        return last >= steps - 1 and (self._epoch + 1) % self._every == 0

    def on_train_batch_end(self, batch, logs=None):
        # Keras calls back once per call of the train function, with the index of its
        # last step: steps_per_execution steps (fewer at an epoch's end).
        first = batch if self._first_batch is None else min(self._first_batch, batch)
        self._per_call = batch - first + 1
        self._time_step(self._per_call)
        ends = self._ends_interval(first, batch)
        if not self._measured and self._threshold is not None \
                and len(self._plan_steps) >= self.LOW_RANK_AFTER and not ends:
            # The low-rank candidates' first measurement: once the first plan's steps are
            # timed rather than at the first interval's end (a no-op without them), unless
            # this step ends an interval, whose ``adapt`` measures them anyway.
            self._measured = True
            began = time.perf_counter()
            self._strategy.cross_device_ops.measure_low_rank(
                steps_left=self._steps_left(self._per_call),
                min_gain_s=self._min_gain_s(),
                trial_steps=self._trial_steps(self._per_call), **self._plan_step())
            self.measure_s = time.perf_counter() - began
        self._steps += self._per_call
        self._fit_steps += self._per_call
        self._first_batch = None
        if self._every_steps is not None and ends:
            self._end_interval(self._epoch, logs)
        self._note_change()

    def _time_step(self, steps=1):
        """The step's seconds (a call's over its ``steps``): what a change of plan cost,
        when the step followed one (its retrace and the steps that settle after it),
        else one more ordinary step (of the plan's, once settled). Until a change has
        been timed, a fit's first step (a trace, less the planner's measuring in it)
        stands for one: the most any fit's first step cost."""
        if self._began is None:
            return
        seconds = (time.perf_counter() - self._began) / steps
        if self._after_change:
            # Priced once there are ordinary steps to compare with (a change right after
            # the first step comes before any). A change before the last was priced
            # is not priced at all: its retrace and this one are not told apart.
            self._after_change, self._change_steps = False, [(seconds, steps)]
            self._first_trace = False
            self._settling = self.SETTLE_STEPS
        elif self._settling > 0:
            # Warming up after a trace: neither an ordinary step nor the plan's.
            self._settling -= 1
            if self._change_steps is not None:
                self._change_steps.append((seconds, steps))
        elif self._traced:
            self._durations.append(seconds)
            self._plan_steps.append(seconds)
        else:
            self._traced = True  # a fit's first step traces: not an ordinary one
            self._settling = self.SETTLE_STEPS
            if not self._change_timed:
                # Until a change of plan is timed, the trace stands for what its retrace
                # costs, less what the planner measured in it (the link and the CPU).
                measured = self._strategy.cross_device_ops.measuring_s - self._measuring_from
                self._change_steps = [(max(seconds - measured / steps, 0.0), steps)]
                self._first_trace = True
        if self._change_steps is not None and self._settling == 0 and self._durations:
            ordinary = float(np.median(self._durations))
            priced = sum(n * max(s - ordinary, 0.0) for s, n in self._change_steps)
            # A later fit's first step may reuse the traced function: the most stands.
            self.change_s = max(self.change_s, priced) if self._first_trace else priced
            self._change_timed = self._change_timed or not self._first_trace
            if not self._first_trace:
                self.retraces.append(priced)
            self._change_steps = None

    def on_train_end(self, logs=None):
        if self._fit_began is None:
            return
        fit_s = time.perf_counter() - self._fit_began
        spent = float(sum(self.retraces))
        if len(self.retraces) < 2 or fit_s <= 0 or spent < self.RETRACE_SHARE * fit_s:
            return
        interval = (f"every_steps={self._every_steps}" if self._every_steps is not None
                    else f"every_epochs={self._every}")
        ordinary = float(np.median(self._durations)) if self._durations else 0.0
        why = ("where the critical regimes move at every interval's end, the plan does "
               f"too. A longer interval than {interval} sums more steps, whose norms move "
               "less, and changes less often" if self._threshold is not None else
               f"a longer interval than {interval} plans again less often")
        logging.warning(
            "tfgc: AutoPlanCallback: %d changes of plan took %.1f s of this fit's %.1f s "
            "(%.0f%%; %.1f s each, where the interval's %d steps took about %.1f s): a "
            "change retraces the train function, and %s",
            len(self.retraces), spent, fit_s, 100 * spent / fit_s,
            spent / len(self.retraces), self._interval_steps(),
            self._interval_steps() * ordinary, why)

    def _note_change(self):
        generation = self._strategy.cross_device_ops.generation
        if generation != self._generation:
            self._generation = generation
            self._after_change = True
            self._plan_steps = collections.deque(maxlen=256)

    def _plan_step(self):
        """The current plan's step and its standard error, as ``adapt`` and
        ``measure_low_rank`` take them (``step_s``, ``step_se_s``; both None before any
        ordinary step).

        The step: the median of its ordinary steps, the least of them while fewer than
        three (the median of two is their mean, half of it a slow one's). Its error,
        from the steps' spread sigma (1.4826 times their median absolute deviation, a
        normal's sigma): for the median of n steps, 1.2533 sigma (a median's error over
        a mean's, for normal noise) over sqrt(n); for the least of two, or one step,
        sigma (the least of two normal draws lies 0.564 sigma low, and spreads 0.826
        sigma about that, together about sigma). The spread is the plan's own steps'
        once it has ``SPREAD_FROM``, the recent ordinary steps' before (earlier plans'
        included), and at least ``SPREAD_PRIOR`` of the step while those are fewer as
        well (two steps that happen to agree say little of the spread)."""
        steps = self._plan_steps
        if not steps:
            return {"step_s": None, "step_se_s": None}
        n = len(steps)
        step = float(np.median(steps)) if n >= 3 else float(min(steps))
        pool = np.asarray(steps if n >= self.SPREAD_FROM else self._durations)
        sigma = 1.4826 * float(np.median(np.abs(pool - np.median(pool)))) if len(pool) else 0.0
        if len(pool) < self.SPREAD_FROM:
            sigma = max(sigma, self.SPREAD_PRIOR * step)
        return {"step_s": step,
                "step_se_s": sigma if n < 3 else 1.2533 * sigma / math.sqrt(n)}

    def _interval_steps(self):
        if self._every_steps is not None:
            return self._every_steps
        return max(1, ((self.params or {}).get("steps") or 1) * self._every)

    def _trial_steps(self, running=0):
        """The steps a plan taken now runs before the planner weighs its steps (the next
        interval's end), after those counted and ``running`` more: to the next multiple
        of ``every_steps``, or a whole interval where intervals are epochs."""
        if self._every_steps is None:
            return self._interval_steps()
        return self._every_steps - (self._steps + running) % self._every_steps

    def _steps_left(self, running=0):
        """The steps left of the fit after those counted and ``running`` more (Keras'
        ``epochs`` from the fit's first, times ``steps``, less the steps of the first
        epoch before the one it resumed at), or None where Keras does not know them."""
        params = self.params or {}
        if not (params.get("steps") and params.get("epochs")):
            return None
        # A resumed fit (``initial_epoch``, ``BackupAndRestore``) starts at a later
        # epoch, and at a later step of it after a mid-epoch backup; ``epochs`` is the
        # last.
        epochs = int(params["epochs"]) - (self._first_epoch or 0)
        return max(int(params["steps"]) * epochs - (self._first_step or 0)
                   - self._fit_steps - running, 0)

    def _min_gain_s(self):
        """What a new plan must save a step to pay for its change: ``_change_price``
        over ``_payback_steps``."""
        return self._change_price() / self._payback_steps()

    def _change_price(self):
        """What a change of plan costs as far as the steps tell now: ``change_s``, but
        while a retrace (or, before any change is timed, the fit's first trace) waits
        for ordinary steps to be priced against, at least its steps' seconds beyond
        the ordinary steps timed so far (all of them where none is): an interval of
        one or two steps, or one ``steps_per_execution`` call, ends before those. The
        bound holds the ordinary steps in them too, so it errs on the side of keeping
        the plan."""
        pending = self._change_steps
        if pending is None:
            return self.change_s
        ordinary = float(np.median(self._durations)) if self._durations else 0.0
        bound = sum(n * max(s - ordinary, 0.0) for s, n in pending)
        return max(self.change_s, bound) if self._first_trace else bound

    def _payback_steps(self):
        """The steps over which a change of plan must pay for itself: what is left of the
        fit (Keras' ``epochs`` times ``steps``), or an interval where that is unknown or
        shorter."""
        return max(self._interval_steps(), self._steps_left() or 0)

    def _learning_rate(self):
        """The rate the model's optimizer gives its next step: a schedule's at the steps
        it ran (tf-keras' ``learning_rate`` is the last step's), a number or variable as
        it is now; None where it has no optimizer, the rate cannot be read as a number
        (said once), or ``watch_learning_rate`` is off. Only worker 0's is used, and a
        failed read never stops the fit."""
        optimizer = getattr(self.model, "optimizer", None) if self._watch_rate else None
        if optimizer is None:
            return None
        def schedule(value):
            """A LearningRateSchedule: callable, and not a number or variable."""
            return callable(value) and not hasattr(value, "numpy")

        try:
            inner = optimizer
            while getattr(inner, "inner_optimizer", None) is not None:  # loss scaling
                inner = inner.inner_optimizer
            # The schedule itself where the optimizer keeps one (tf-keras' and Keras
            # 3's), else what ``learning_rate`` gives (a legacy optimizer's schedule).
            rate = getattr(inner, "_learning_rate", None)
            if not schedule(rate):
                rate = optimizer.learning_rate
            if schedule(rate):
                rate = rate(inner.iterations)
            rate = float(np.asarray(rate.numpy() if hasattr(rate, "numpy") else rate))
        except Exception as exc:  # pylint: disable=broad-except
            if not self._rate_unread:
                logging.warning("tfgc: AutoPlanCallback could not read the optimizer's "
                                "learning rate (%s: %s); only the norms mark regimes",
                                type(exc).__name__, exc)
                self._rate_unread = True
            return None
        return rate if math.isfinite(rate) and rate >= 0 else None

    def on_epoch_end(self, epoch, logs=None):
        if self._every_steps is None and (epoch + 1) % self._every == 0:
            self._end_interval(epoch, logs)
            self._note_change()

    def _end_interval(self, epoch, logs):
        cdo = self._strategy.cross_device_ops
        critical = frozenset()
        generation = cdo.generation
        began = time.perf_counter()
        if self._threshold is not None:
            critical = cdo.adapt(self._threshold,
                                 min_gain_s=self._min_gain_s(),
                                 steps_left=self._steps_left(),
                                 trial_steps=self._trial_steps(),
                                 learning_rate=self._learning_rate(), noise=self._noise,
                                 **self._plan_step())
            self._measured = True  # the low-rank errors too, where they are candidates
        adapted = time.perf_counter()
        due = self._margin is not None and (
            self._probed_at is None
            or (adapted - self._probed_at) * self._link_share >= self._probe_s)
        # Called at every interval's end, due or not: worker 0's word is all-gathered.
        replanned = cdo.replan(self._margin, due=due) if self._margin is not None else False
        ended = time.perf_counter()
        if due:
            self._probe_s, self._probed_at = ended - adapted, ended
        self.costs.append({"step": self._steps, "adapt_s": adapted - began,
                           "replan_s": ended - adapted, "link_due": due,
                           "new_plan": cdo.generation != generation})
        self.history.append((epoch, sorted(critical), replanned))
        if logs is not None:
            logs.update({"auto_critical": float(len(critical)),
                         "auto_replanned": float(replanned)})


def _plugin_metadata(plugin_name):
    """What marks a summary for one of TensorBoard's dashboards ("scalars", "text").

    ``tf.summary.scalar`` and ``tf.summary.text`` need the tensorboard package; writing
    the tensor (a float32 scalar, a string) with this metadata records the same event
    without it.
    """
    from tensorflow.core.framework import summary_pb2
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin_name))


_SCALAR_METADATA = _plugin_metadata("scalars")
_TEXT_METADATA = _plugin_metadata("text")
