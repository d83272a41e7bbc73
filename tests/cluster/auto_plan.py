"""A cluster worker for ``compressor="auto"``.

    auto_plan.py OUT_DIR

1. For each setting of ``FIXED`` (a link rate given, so the plan does not depend on the
   machine), reduces the same per-worker "gradients" of ``SHAPES`` for ``STEPS`` steps
   over fresh variables and writes the outputs (``fixed<i>.w<rank>.npz``) and the
   plan, the uncompressed list and the statistics (``fixed<i>.w<rank>.json``).
2. With the link measured (``compressor="auto"``), trains the MLP for a few steps
   (``brief_fit``), asks for the link again with worker 0 saying it is not due, then
   measures it again (``replan`` with no margin, worker 0 saying it is due) and writes the
   plans, their digests and the uncompressed list (``results.w<rank>.json``, with
   the losses).
3. Trains the MLP for ``EPOCHS`` epochs under ``tfgc.keras.AutoPlanCallback`` and writes
   each epoch's plan, interval norms and critical set (``regimes.w<rank>.json``).
4. Trains under a measured plan, saves a checkpoint of the optimizer, starts afresh (a
   new model, the compressor set again) with that checkpoint restored before the first
   step; then again with the same record restored as if written on a link 50 times
   slower; then the first record twice under a given link, the second time the record
   written under it. Writes the plans, the first three runs' link figures, the counts of
   measurements and of plans made afresh for another link, and the given runs' counts,
   links and plans (``restart.w<rank>.json``).
5. Trains the MLP with low-rank candidates on a slow given link, ``AutoPlanCallback``
   every ``LOW_RANK_EVERY`` steps, and writes the plan after the first step and, after
   each interval, the plan, its low-rank error and budget and the measured errors
   (``low_rank.w<rank>.json``).
6. Reduces ``gradients`` over fresh variables with low rank planned from the second
   step, then switches to a plan without low rank (quantizers, then float32 alone)
   and reduces zeros (after, for the quantizers, a step that a NaN on worker 1
   skips): writes the residuals before the switch and what the zeros brought, then
   switches plans once more (``moved.w<rank>.npz``).
7. The same for explicit switches of compressor: one step under error feedback
   (``SWITCHED_FROM``), then each of ``SWITCHED_TO`` (QSGD, whose guard checks the
   step, and bf16, on tfgc's path; identity, the stock all-reduce), a step that a NaN
   on worker 1 skips, a step of zeros, and a switch back with a step of zeros
   (``switched.w<rank>.npz``).
8. Trains a model of two embedding tables under ``AutoPlanCallback`` on a slow given
   link: a small one of which each step touches nearly every row, and a large one of which it
   touches ``FEW_ROWS``. Writes the plan (with its tables) after the first step and after
   each interval, the losses and the weights, then the statistics of two more steps
   under the last plan (``tables.w<rank>.json``, ``tables.w<rank>.npz``); then saves a
   checkpoint of the optimizer, restores it into a new model with the compressor set
   afresh, and writes the plan of its first step (``restored``).
9. With regimes tracked on a slow given link, reduces a kernel's gradient and a large
   table's rows for ``len(ROWS_NAN)`` steps, the rows of worker 1 holding a NaN where
   ``ROWS_NAN`` says: writes each step's reduced kernel, worker 0's interval sums
   after each step and the count of skipped steps (``rows_skip.w<rank>.npz``).
10. With regimes tracked on a slow given link, reduces a kernel whose gradients have
   fewer non-zero entries than top-k keeps, scattered (``sparse_gradient``), for two
   intervals of one step each (the first ends critical), then, under the plan that
   makes, ``SPARSE_STEPS`` more: writes the plans and, per step, the gradient, the
   error-feedback residual before and after, and the result (``sparse.w<rank>.npz``).
11. Trains two models of different input widths in turn under ``AutoPlanCallback`` on
   a slow given link (``ALTERNATE_WIDTHS``, a fit each, the first model again last):
   the plan's gradients after each fit, the losses and both models' weights
   (``alternating.w<rank>.json``, ``alternating.w<rank>.npz``).
12. Trains a GAN whose ``train_step`` applies two optimizers (a generator's and a
   discriminator's gradients, two reductions a step) under ``AutoPlanCallback`` on a
   slow given link: each interval's plans (``compression_plans``) and generation, the
   communication each set's timed steps were set against and what the plans that ran
   predict, the losses and the weights (``gan.w<rank>.json``, ``gan.w<rank>.npz``);
   then saves both optimizers' checkpoint, restores it into a new GAN with the
   compressor set afresh and writes the plans of its first step and the count of
   measurements before and after; then has the workers pin different choices (each
   refusal's message), pins every gradient as ``GAN_PIN`` (``pin_plan``) for two steps
   (their plans and bytes) and gives the choice back for one.
13. Trains a bag of embeddings whose head is below the policy's size (the table the
   only gradient to plan) under ``AutoPlanCallback`` on a slow given link: its plans
   and the gradients sent as they are after the first step and at the end, the losses
   and the weights (``bag.w<rank>.json``, ``bag.w<rank>.npz``).
"""

import dataclasses
import json
import os
import sys

import numpy as np

# Kernels of 32768, 6144 and 1920 elements and a bias (sent dense by the policy).
SHAPES = [(256, 128), (96, 64), (48, 40), (40,)]
STEPS = 3
EPOCHS = 4
LOW_RANK_EVERY = 3
FIXED = [
    # A link so slow that the wire decides, and a budget below rotated 8 bits' bound on
    # the largest kernel: that one in bf16, the others in rotated 8 bits.
    "auto:link_gbps=0.001,error=0.00015",
    # A fast link: every kernel as float32.
    "auto:link_gbps=1000",
    # A slow link and room for rotated 4 bits on the two small kernels.
    "auto:link_gbps=0.001,error=0.02",
]


def gradients(rank, step):
    rng = np.random.RandomState(100 * step + rank)
    return [rng.randn(*shape).astype(np.float32) for shape in SHAPES]


def main():
    out_dir = sys.argv[1]
    import tensorflow as tf

    import tfgc
    from brief_fit import brief_fit
    from fixed_reduce import make_reduce
    from tfgc.apps.train import worker_info

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor=FIXED[0])
    rank, n = worker_info(strategy)
    for k, spec in enumerate(FIXED):
        strategy.compressor = spec
        with strategy.scope():
            variables = [tf.Variable(tf.zeros(shape), name=f"g{j}")
                         for j, shape in enumerate(SHAPES)]
        reduce = make_reduce(strategy, variables, tf.Module())
        strategy.compression_stats()  # read before: the figures below are this run's
        arrays = {}
        for step in range(STEPS):
            for j, r in enumerate(reduce(gradients(rank, step))):
                arrays[f"out{step}_{j}"] = r
        np.savez(os.path.join(out_dir, f"fixed{k}.w{rank}.npz"), **arrays)
        plan = strategy.compression_plan()
        with open(os.path.join(out_dir, f"fixed{k}.w{rank}.json"), "w") as f:
            json.dump({"plan": plan.as_dicts(), "digest": plan.digest(),
                       "mean_error": plan.mean_error, "table": plan.table(),
                       "uncompressed": strategy.uncompressed_gradients(),
                       "stats": strategy.compression_stats()}, f)

    strategy.compressor = "auto"
    losses = brief_fit(strategy, rank, n, out_dir, steps_per_epoch=8)
    plan = strategy.compression_plan()
    cdo = strategy.cross_device_ops
    before = cdo._auto.figures.link_us  # pylint: disable=protected-access
    # Worker 0 says the link is not due: no worker measures it, whatever it says.
    skipped = cdo.replan(margin=0.0, due=rank != 0)
    unmeasured = cdo._auto.figures.link_us  # pylint: disable=protected-access
    # Worker 0 says it is due: every worker measures; any change plans again.
    changed = cdo.replan(margin=0.0, due=rank == 0)
    after = cdo._auto.figures.link_us  # pylint: disable=protected-access
    with open(os.path.join(out_dir, f"results.w{rank}.json"), "w") as f:
        json.dump({"losses": losses, "plan": plan.as_dicts(), "digest": plan.digest(),
                   "table": plan.table(), "link": [plan.link.alpha, plan.link.beta],
                   "uncompressed": strategy.uncompressed_gradients(),
                   "replan": {"before": before, "after": after, "changed": changed,
                              "skipped": skipped, "unmeasured": unmeasured,
                              "plan": strategy.compression_plan().as_dicts()}}, f)
    regimes(strategy, rank, n, out_dir)
    restart(strategy, rank, n, out_dir)
    low_rank(strategy, rank, n, out_dir)
    moved_off_low_rank(strategy, rank, out_dir)
    switched_off_error_feedback(strategy, rank, out_dir)
    tables(strategy, rank, out_dir)
    skipped_rows(strategy, rank, out_dir)
    planned_top_k(strategy, rank, out_dir)
    alternating(strategy, rank, n, out_dir)
    gan(strategy, rank, n, out_dir)
    bag(strategy, rank, out_dir)


MOVED_TO = ["auto:link_gbps=0.001,error=0.00015,low_rank=0", "auto:link_gbps=1000,low_rank=0"]


def moved_off_low_rank(strategy, rank, out_dir):
    """Step 6 of the module docstring."""
    import tensorflow as tf

    import tfgc
    from fixed_reduce import make_reduce

    cdo = strategy.cross_device_ops
    arrays = {}
    for k, spec in enumerate(MOVED_TO):
        strategy.compressor = "auto:link_gbps=0.01,low_rank=2,critical_error=1"
        with strategy.scope():
            variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]
        owner = tf.Module()
        cdo.track_regimes()
        make_reduce(strategy, variables, owner)(gradients(rank, 0))
        cdo.measure_low_rank()  # low rank from the next step on
        make_reduce(strategy, variables, owner)(gradients(rank, 1))
        state = tfgc.distribute.state.get_state(owner)
        arrays[f"labels{k}"] = np.array([e.label for e in strategy.compression_plan().entries])
        for j, var in enumerate(variables):
            slot = state.slot(var, 0) if state.has_slot(var) else {}
            arrays[f"residual{k}_{j}"] = (slot["residual"].numpy() if "residual" in slot
                                          else np.zeros(SHAPES[j], np.float32))
        strategy.compressor = spec
        zeros = [np.zeros(shape, np.float32) for shape in SHAPES]
        reduce = make_reduce(strategy, variables, owner)
        if k == 0:
            # A step that worker 1's NaN skips (the quantizers' guard): nothing sent,
            # so nothing kept apart may go.
            reduce([z + (np.nan if rank == 1 else 0.0) for z in zeros])
            for j, var in enumerate(variables):
                carried = state.carried(var, 0)
                arrays[f"after_skip{k}_{j}"] = (np.zeros([0]) if carried is None
                                                else carried.numpy())
        for j, out in enumerate(reduce(zeros)):
            arrays[f"out{k}_{j}"] = out
            carried = state.carried(variables[j], 0)
            arrays[f"carried{k}_{j}"] = (np.zeros([0]) if carried is None
                                         else carried.numpy())
        arrays[f"moved_to{k}"] = np.array([e.label for e in strategy.compression_plan().entries])
        # One more change of plan: what was kept apart, sent by now, is let go.
        strategy.compressor = MOVED_TO[1 - k]
        make_reduce(strategy, variables, owner)(zeros)
        arrays[f"kept_after{k}"] = np.array([state.carried(v, 0) is not None
                                             for v in variables])
    np.savez(os.path.join(out_dir, f"moved.w{rank}.npz"), **arrays)


def low_rank(strategy, rank, num_workers, out_dir):
    """Step 5 of the module docstring. Regimes with an unreachable threshold: every
    gradient is critical until two intervals can be compared, none after. No limit on
    a critical gradient's measured error (``critical_error``), so that the critical
    rank alone decides (this MLP's errors at the fourth step are its data's)."""
    import tf_keras as keras

    import tfgc
    from brief_fit import brief_fit

    strategy.compressor = "auto:link_gbps=0.01,low_rank=2,critical_error=1"
    auto = strategy.cross_device_ops._auto  # pylint: disable=protected-access
    intervals, first, recomputed = [], [], []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not first and callback._measured:  # pylint: disable=protected-access
                # The plan after the first measurement (once the first plan's steps
                # were timed), and the step that made it.
                first.append((strategy.compression_plan().as_dicts(), batch))
            if len(callback.history) > len(intervals):
                plan = strategy.compression_plan()
                if rank == 0:
                    # The errors again from the gradients worker 0 kept (the measured
                    # ones): of the gradient alone, whatever residual its plan holds.
                    recomputed.append(_errors_of_kept(auto))
                intervals.append({
                    "plan": plan.as_dicts(), "low_rank_error": plan.low_rank_error,
                    "low_rank_budget": plan.low_rank_budget,
                    "errors": {name: [sq, {str(r): e for r, e in rel.items()}]
                               for name, (sq, rel) in auto._low_rank.items()}})  # pylint: disable=protected-access

    callback = tfgc.keras.AutoPlanCallback(strategy, threshold=1e9, link_margin=None,
                                           every_steps=LOW_RANK_EVERY)
    # Three epochs of a long training: the low-rank candidates' timing pays over the
    # steps it has left (``planner.timing_pays``), as it would not over a fit of 18.
    losses = brief_fit(strategy, rank, num_workers, out_dir, steps_per_epoch=6, epochs=3,
                       callbacks=[callback, Record()], name="low_rank", planned_epochs=100)
    with open(os.path.join(out_dir, f"low_rank.w{rank}.json"), "w") as f:
        json.dump({"first": first[0][0], "first_at": first[0][1], "intervals": intervals,
                   "losses": losses,
                   "steps": {key: list(v) for key, v in auto._shown().steps.items()}},  # pylint: disable=protected-access
                  f)
    if rank == 0:
        with open(os.path.join(out_dir, "low_rank_recomputed.w0.json"), "w") as f:
            json.dump(recomputed, f)


def _errors_of_kept(auto):
    """By gradient name, ``planner.measured_errors`` of the local gradient that worker 0
    kept for the last measurement (keys as strings, as the JSON holds them)."""
    from tfgc.distribute import planner

    lay = auto._shown()  # pylint: disable=protected-access
    out = {}
    for j in lay.matrices:
        sq, rel = planner.measured_errors(lay.last[j].numpy(), seed=j)
        out[lay.gradients[j][0]] = [sq, {str(key): e for key, e in rel.items()}]
    return out


def restart(strategy, rank, num_workers, out_dir):
    """Step 4 of the module docstring."""
    import tensorflow as tf

    from brief_fit import brief_fit

    strategy.compressor = "auto"
    auto = strategy.cross_device_ops._auto  # pylint: disable=protected-access
    nets = []
    brief_fit(strategy, rank, num_workers, out_dir, steps_per_epoch=3, epochs=1,
              name="saved", before_fit=nets.append)
    saved, saved_link = strategy.compression_plan(), list(auto.figures.link_us)
    record = auto.snapshot()
    path = tf.train.Checkpoint(optimizer=nets[0].optimizer).save(
        os.path.join(out_dir, f"ckpt.w{rank}", "ckpt"))
    measured = auto.measurements
    strategy.compressor = "auto"  # afresh: a new generation, no plan, nothing measured

    def restore(net):
        tf.train.Checkpoint(optimizer=net.optimizer).restore(path)

    brief_fit(strategy, rank, num_workers, out_dir, steps_per_epoch=3, epochs=1,
              name="restored", before_fit=restore)
    restored = strategy.compression_plan()
    restored_link, relinked = list(auto.figures.link_us), auto.relinked

    # The same record as if written on a network 50 times slower: restored (as the
    # record's checkpoint dependency hands it over), its link measured again at the
    # first plan, and planned afresh.
    strategy.compressor = "auto"
    auto.restored(dict(record, link_us=[50 * us for us in record["link_us"]]))
    brief_fit(strategy, rank, num_workers, out_dir, steps_per_epoch=3, epochs=1,
              name="elsewhere")
    elsewhere_link, relinked_elsewhere = list(auto.figures.link_us), auto.relinked

    # The measured record restored under a given link: planned afresh for the given
    # one; its record restored under the same given link: its plan back, as it was.
    given = []
    for _ in range(2):
        strategy.compressor = "auto:link_gbps=0.002"
        auto.restored(record)
        brief_fit(strategy, rank, num_workers, out_dir, steps_per_epoch=3, epochs=1,
                  name="given")
        given.append([auto.relinked, auto.figures.link_gbps, strategy.compression_plan().key()])
        record = auto.snapshot()
    with open(os.path.join(out_dir, f"restart.w{rank}.json"), "w") as f:
        json.dump({"saved": saved.key(), "restored": restored.key(),
                   "link_us": [saved_link, restored_link, elsewhere_link],
                   "relinked": [relinked, relinked_elsewhere],
                   "given": given, "given_record": [record.get("link_gbps"),
                                                    record.get("latency_ms")],
                   "measurements": [measured, auto.measurements]}, f)


def regimes(strategy, rank, num_workers, out_dir):
    """Trains the MLP for ``EPOCHS`` epochs with ``AutoPlanCallback`` on a slow given link
    (so every gradient is worth compressing) and writes, per epoch, the plan it trained
    with, the interval's norms and the critical set the callback chose."""
    import tf_keras as keras

    import tfgc
    from brief_fit import brief_fit

    # 1 Mbit/s: rotated 4 bits against 8 on the smallest kernel (1280 elements) saves
    # 640 bytes, 5 ms a step, where the two quantizers' CPU figures at that size differ
    # by 0.2 ms or less on 2 workers of a loaded 2-core machine. At 10 Mbit/s the 0.5 ms
    # saved was within that noise, and a plan once gave the kernel 8 bits.
    strategy.compressor = "auto:link_gbps=0.001,error=2,low_rank=0"
    cdo = strategy.cross_device_ops
    epochs = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epochs.append({"plan": strategy.compression_plan().as_dicts()})

    class Norms(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epochs[-1]["norms"] = {str(k): v for k, v in cdo._auto.norms.items()}  # pylint: disable=protected-access

    auto = tfgc.keras.AutoPlanCallback(strategy, threshold=0.5, link_margin=None)
    # A long fit's first epochs: a change of plan pays for its retrace over the steps
    # the fit says are left.
    brief_fit(strategy, rank, num_workers, out_dir, steps_per_epoch=6, epochs=EPOCHS,
              callbacks=[Record(), auto, Norms()], name="regimes", planned_epochs=1000)
    with open(os.path.join(out_dir, f"regimes.w{rank}.json"), "w") as f:
        json.dump({"epochs": epochs, "history": auto.history}, f)


SWITCHED_FROM = "ef+topk:ratio=0.01"
SWITCHED_TO = ["qsgd", "bf16", "none"]


def switched_off_error_feedback(strategy, rank, out_dir):
    """Step 7 of the module docstring."""
    import tensorflow as tf

    import tfgc
    from fixed_reduce import make_reduce

    arrays = {}
    zeros = [np.zeros(shape, np.float32) for shape in SHAPES]
    for k, spec in enumerate(SWITCHED_TO):
        strategy.compressor = SWITCHED_FROM
        with strategy.scope():
            variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]
        owner = tf.Module()
        make_reduce(strategy, variables, owner)(gradients(rank, 0))
        state = tfgc.distribute.state.get_state(owner)
        for j, var in enumerate(variables):
            slot = state.slot(var, 0) if state.has_slot(var) else {}
            arrays[f"residual{k}_{j}"] = (slot["residual"].numpy() if "residual" in slot
                                          else np.zeros(SHAPES[j], np.float32))
        strategy.compressor = spec
        reduce = make_reduce(strategy, variables, owner)
        reduce([z + (np.nan if rank == 1 else 0.0) for z in zeros])
        for j, var in enumerate(variables):
            carried = state.carried(var, 0)
            arrays[f"after_skip{k}_{j}"] = (np.zeros([0]) if carried is None
                                            else carried.numpy())
        arrays[f"pending_after_skip{k}"] = bool(state.carried_pending(0).numpy())
        for j, out in enumerate(reduce(zeros)):
            arrays[f"out{k}_{j}"] = out
            carried = state.carried(variables[j], 0)
            arrays[f"carried{k}_{j}"] = (np.zeros([0]) if carried is None
                                         else carried.numpy())
        arrays[f"pending_after_send{k}"] = bool(state.carried_pending(0).numpy())
        # Back to error feedback: what was kept apart, sent by now, joins the new
        # residual as zeros; a step of zeros leaves that residual at zero.
        strategy.compressor = SWITCHED_FROM
        make_reduce(strategy, variables, owner)(zeros)
        arrays[f"kept_after{k}"] = np.array([state.carried(v, 0) is not None
                                             for v in variables])
        for j, var in enumerate(variables):
            slot = state.slot(var, 0) if state.has_slot(var) else {}
            arrays[f"residual_after{k}_{j}"] = (slot["residual"].numpy() if "residual" in slot
                                                else np.zeros([0]))
    np.savez(os.path.join(out_dir, f"switched.w{rank}.npz"), **arrays)


# Step 8: the small table (nearly every row touched each step) and the large one
# (FEW_ROWS of it touched), and the tokens per sequence.
SMALL_TABLE, LARGE_TABLE, FEW_ROWS, TOKENS = (96, 64), (4096, 64), 16, 24


# Low rank and top-k among the candidates: a fit long enough for a change to pay times
# them. (When a dense table's share of the low-rank budget was the others' too, the plan
# then sent both tables dense and the hidden kernel top-k, spending the small table's
# share.)
TABLES_SPEC = "auto:link_gbps=0.001"


def tables(strategy, rank, out_dir):
    """Step 8 of the module docstring."""
    import tensorflow as tf
    import tf_keras as keras

    import tfgc

    strategy.compressor = TABLES_SPEC
    rng = np.random.RandomState(7 + rank)
    batches, batch = 12, 32
    # Each sequence: tokens of one half of the small table, the half its label says
    # (about every row of it each batch), and of FEW_ROWS rows of the large one.
    half = SMALL_TABLE[0] // 2
    labels = rng.randint(2, size=(batches, batch))
    small = rng.randint(half, size=(batches, batch, TOKENS)) + half * labels[:, :, None]
    few = rng.choice(LARGE_TABLE[0], size=(batches, FEW_ROWS), replace=False)
    large = np.stack([f[rng.randint(FEW_ROWS, size=(batch, TOKENS))] for f in few])
    data = tf.data.Dataset.from_tensor_slices(
        ((small.reshape(-1, TOKENS), large.reshape(-1, TOKENS)), labels.reshape(-1)))
    data = data.batch(batch).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    def build():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            a, b = keras.Input([TOKENS], dtype="int32"), keras.Input([TOKENS], dtype="int32")
            x = keras.layers.Concatenate()([
                keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(
                    *SMALL_TABLE, name="small_table")(a)),
                keras.layers.Flatten()(keras.layers.Embedding(*LARGE_TABLE,
                                                              name="large_table")(b))])
            # Named: a second model's layers get the same names (the restored plan's).
            x = keras.layers.Dense(32, activation="relu", name="hidden")(x)
            net = keras.Model([a, b], keras.layers.Dense(2, name="logits")(x))
            net.compile(optimizer=keras.optimizers.Adam(0.01),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return net

    net = build()
    plans = []

    def record():
        plan = strategy.compression_plan()
        plans.append({"entries": plan.as_dicts(), "digest": plan.digest(), "key": plan.key(),
                      "tables": [dataclasses.asdict(t) for t in plan.tables],
                      "table": plan.table()})

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not plans or len(callback.history) > len(plans) - 1:
                record()

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = epoch == 1

    callback = tfgc.keras.AutoPlanCallback(strategy, threshold=1e9, link_margin=None,
                                           every_steps=LOW_RANK_EVERY)
    # Two epochs of a long fit, stopped as an early stop would: a change of plan pays
    # for its retrace over the steps the fit says are left (``AutoPlanCallback``).
    history = net.fit(data.with_options(options), epochs=1000, steps_per_epoch=6, verbose=0,
                      callbacks=[callback, Record(), Stop()])
    # The last interval's (mean, noise, level) of each gradient, by name, tables' rows
    # too.
    lay = strategy.cross_device_ops._auto._shown()  # pylint: disable=protected-access
    norms = {lay.gradients[j][0]: list(v) for j, v in lay.norms.items()}
    np.savez(os.path.join(out_dir, f"tables.w{rank}.npz"), *[w.numpy() for w in net.weights])
    # Two more steps under the last plan, for its bytes.
    strategy.compression_stats()
    net.fit(data.with_options(options), epochs=1, steps_per_epoch=2, verbose=0)
    record()
    # Saved, then restored into a new model (the compressor set afresh): its first
    # step's plan.
    path = tf.train.Checkpoint(optimizer=net.optimizer).save(
        os.path.join(out_dir, f"tables_ckpt.w{rank}", "ckpt"))
    stats, uncompressed = strategy.compression_stats(), strategy.uncompressed_gradients()
    saved = len(plans)
    strategy.compressor = TABLES_SPEC
    net = build()
    tf.train.Checkpoint(optimizer=net.optimizer).restore(path)

    class First(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                record()

    # Not ``callback``: ``Record`` reads that one's history.
    again = tfgc.keras.AutoPlanCallback(strategy, threshold=1e9, link_margin=None,
                                        every_steps=LOW_RANK_EVERY)
    net.fit(data.with_options(options), epochs=1, steps_per_epoch=1, verbose=0,
            callbacks=[again, First()])
    with open(os.path.join(out_dir, f"tables.w{rank}.json"), "w") as f:
        json.dump({"plans": plans[:saved], "restored": plans[saved:],
                   "losses": [float(v) for v in history.history["loss"]],
                   "uncompressed": uncompressed, "stats": stats, "norms": norms}, f)


# Step 9: the steps whose rows hold a NaN on worker 1.
ROWS_NAN = (False, True, False)


def skipped_rows(strategy, rank, out_dir):
    """Step 9 of the module docstring."""
    import tensorflow as tf

    import tfgc

    strategy.compressor = "auto:link_gbps=0.001,low_rank=0"
    cdo = strategy.cross_device_ops
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(SHAPES[0])), tf.Variable(tf.zeros(LARGE_TABLE))]
    # This step's gradients, read by the traced step (one trace for every step).
    kernel = tf.Variable(tf.zeros(SHAPES[0]))
    rows = tf.Variable(tf.zeros([FEW_ROWS, LARGE_TABLE[1]]))
    indices = tf.constant(np.arange(FEW_ROWS) * (LARGE_TABLE[0] // FEW_ROWS), tf.int64)
    owner = tf.Module()

    @tf.function
    def reduce():
        def replica_fn():
            grads = [kernel.read_value(), tf.IndexedSlices(
                rows.read_value(), indices, tf.constant(LARGE_TABLE, tf.int64))]
            with tfgc.compress_gradients(variables, owner=owner):
                return tf.distribute.get_replica_context().all_reduce("sum", grads)
        return strategy.run(replica_fn)

    cdo.track_regimes()
    skipped = strategy.compression_stats()["nonfinite_steps"]  # so far, in every step
    rng = np.random.RandomState(rank)
    arrays = {}
    for step, nan in enumerate(ROWS_NAN):
        kernel.assign(rng.randn(*SHAPES[0]).astype(np.float32))
        values = rng.randn(FEW_ROWS, LARGE_TABLE[1]).astype(np.float32)
        if nan and rank == 1:
            values[2, 3] = np.nan
        rows.assign(values)
        out = reduce()[0]
        arrays[f"kernel{step}"] = strategy.experimental_local_results(out)[0].numpy()
        if rank == 0:
            (layout,) = cdo._auto._layouts.values()  # pylint: disable=protected-access
            sums = layout.sums
            arrays[f"sums{step}"] = np.array(
                [v.numpy() for _, v in sorted(sums.items()) if v.shape == SHAPES[0]])
    arrays["nonfinite_steps"] = np.array(strategy.compression_stats()["nonfinite_steps"]
                                         - skipped)
    arrays["labels"] = np.array([e.label for e in strategy.compression_plan().entries])
    np.savez(os.path.join(out_dir, f"rows_skip.w{rank}.npz"), **arrays)


# Step 10: a [1024, 32] kernel (top-k's 1 %: 328 entries) whose gradients have 300
# non-zero entries a worker, at random places: its largest entries hold all of it, and
# its spectrum is nearly flat (rank 2 keeps about 2/32 of it).
SPARSE_SHAPE, SPARSE_NONZEROS, SPARSE_STEPS = (1024, 32), 300, 3


def sparse_gradient(rank, step):
    rng = np.random.RandomState(500 + 10 * step + rank)
    g = np.zeros(SPARSE_SHAPE[0] * SPARSE_SHAPE[1], np.float32)
    g[rng.choice(g.size, SPARSE_NONZEROS, replace=False)] = rng.randn(SPARSE_NONZEROS)
    return g.reshape(SPARSE_SHAPE)


def planned_top_k(strategy, rank, out_dir):
    """Step 10 of the module docstring."""
    import tensorflow as tf

    import tfgc
    from fixed_reduce import make_reduce

    strategy.compressor = "auto:link_gbps=0.01,low_rank=2"
    cdo = strategy.cross_device_ops
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(SPARSE_SHAPE))]
    owner = tf.Module()
    cdo.track_regimes()
    arrays = {}
    for interval in range(2):
        cdo.capture_gradients()
        make_reduce(strategy, variables, owner)([sparse_gradient(rank, interval)])
        cdo.adapt(threshold=1e9)  # no previous norm at the first: critical; then none
        arrays[f"labels{interval}"] = np.array(
            [e.label for e in strategy.compression_plan().entries])
    arrays["paths"] = np.array([e.path for e in strategy.compression_plan().entries])
    reduce = make_reduce(strategy, variables, owner)
    state = tfgc.distribute.state.get_state(owner)

    def residual():
        slot = state.slot(variables[0], 0) if state.has_slot(variables[0]) else {}
        return (slot["residual"].numpy() if "residual" in slot
                else np.zeros(SPARSE_SHAPE, np.float32))

    for step in range(SPARSE_STEPS):
        g = sparse_gradient(rank, 2 + step)
        arrays[f"gradient{step}"], arrays[f"before{step}"] = g, residual()
        arrays[f"out{step}"] = reduce([g])[0]
        arrays[f"after{step}"] = residual()
    np.savez(os.path.join(out_dir, f"sparse.w{rank}.npz"), **arrays)


# Two models trained in turn (a GAN's two halves, say): their input widths, and the steps
# of each fit, AutoPlanCallback's interval.
ALTERNATE_WIDTHS = (48, 24, 48)
ALTERNATE_STEPS, ALTERNATE_EVERY = 4, 2


def alternating(strategy, rank, num_workers, out_dir):
    """Step 11 of the module docstring."""
    import tf_keras as keras

    import tfgc
    from tfgc.apps import data as data_lib

    strategy.compressor = "auto:link_gbps=0.001"
    rng = np.random.RandomState(rank)
    nets = {}
    with strategy.scope():
        for width in sorted(set(ALTERNATE_WIDTHS)):
            keras.utils.set_random_seed(width)
            nets[width] = keras.Sequential([keras.Input((width,)),
                                            keras.layers.Dense(64, activation="relu"),
                                            keras.layers.Dense(1)])
            nets[width].compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    plans, losses = [], []
    for width in ALTERNATE_WIDTHS:
        x = rng.randn(ALTERNATE_STEPS * 8, width).astype(np.float32)
        y = rng.randn(ALTERNATE_STEPS * 8, 1).astype(np.float32)
        history = nets[width].fit(
            data_lib.make_tf_dataset(x, y, 8, shuffle=False, workers=num_workers),
            epochs=1, steps_per_epoch=ALTERNATE_STEPS, verbose=0,
            callbacks=[tfgc.keras.AutoPlanCallback(strategy, every_steps=ALTERNATE_EVERY)])
        losses.append(float(history.history["loss"][0]))
        plans.append([[e.name, list(e.shape), e.label]
                      for e in strategy.compression_plan().entries])
    np.savez(os.path.join(out_dir, f"alternating.w{rank}.npz"),
             **{f"{width}_{i}": w.numpy() for width, net in nets.items()
                for i, w in enumerate(net.weights)})
    with open(os.path.join(out_dir, f"alternating.w{rank}.json"), "w") as f:
        json.dump({"plans": plans, "losses": losses}, f)


# The GAN's noise and sample widths (its kernels: [16, 64] and [64, 32] in the
# generator, [32, 64] in the discriminator; its [64, 1] head is below the policy's
# 1024 elements), its steps and AutoPlanCallback's interval.
GAN_NOISE, GAN_SAMPLE = 16, 32
GAN_STEPS, GAN_EVERY = 12, 3
GAN_PIN = "bf16"


def gan(strategy, rank, num_workers, out_dir):
    """Step 12 of the module docstring."""
    import tensorflow as tf
    import tf_keras as keras

    import tfgc
    from tfgc.apps import data as data_lib

    class Gan(keras.Model):
        """A generator and a discriminator, each with its own optimizer."""

        def __init__(self):
            super().__init__()
            # Named layers: the second GAN's variables are named as the first's, as
            # they would be in a process started again.
            self.generator = keras.Sequential([
                keras.Input((GAN_NOISE,)),
                keras.layers.Dense(64, activation="relu", name="g_hidden"),
                keras.layers.Dense(GAN_SAMPLE, name="g_out")])
            self.discriminator = keras.Sequential([
                keras.Input((GAN_SAMPLE,)),
                keras.layers.Dense(64, activation="relu", name="d_hidden"),
                keras.layers.Dense(1, name="d_out")])
            self.g_opt = keras.optimizers.SGD(0.01)
            self.d_opt = keras.optimizers.SGD(0.01)
            self.bce = keras.losses.BinaryCrossentropy(
                from_logits=True, reduction=keras.losses.Reduction.NONE)

        def mean_bce(self, labels, logits):
            return tf.nn.compute_average_loss(self.bce(labels, logits),
                                              global_batch_size=8 * num_workers)

        def train_step(self, data):
            real, noise = data
            with tf.GradientTape() as tape:
                fake = self.generator(noise)
                d_loss = (self.mean_bce(tf.ones_like(real[:, :1]), self.discriminator(real))
                          + self.mean_bce(tf.zeros_like(real[:, :1]), self.discriminator(fake)))
            d_vars = self.discriminator.trainable_variables
            self.d_opt.apply_gradients(zip(tape.gradient(d_loss, d_vars), d_vars))
            with tf.GradientTape() as tape:
                logits = self.discriminator(self.generator(noise))
                g_loss = self.mean_bce(tf.ones_like(logits), logits)
            g_vars = self.generator.trainable_variables
            self.g_opt.apply_gradients(zip(tape.gradient(g_loss, g_vars), g_vars))
            return {"d_loss": d_loss, "g_loss": g_loss}

    strategy.compressor = "auto:link_gbps=0.001"
    cdo = strategy.cross_device_ops
    rng = np.random.RandomState(rank)
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = Gan()
        model.compile()
    real = (rng.randn(GAN_STEPS * 8, GAN_SAMPLE) * 0.5 + 1.0).astype(np.float32)
    noise = rng.randn(GAN_STEPS * 8, GAN_NOISE).astype(np.float32)
    intervals = []
    running = []

    class Plans(keras.callbacks.Callback):
        """After AutoPlanCallback's interval ends: the plans and the generation, and
        the communication each set's timed steps were set against, with what the
        plans that ran in the interval's last step predict."""

        def on_train_batch_begin(self, batch, logs=None):
            if (batch + 1) % GAN_EVERY == 0:
                running[:] = [(cdo._auto._layout_of(plan), plan.key(),  # pylint: disable=protected-access
                               plan.step_seconds())
                              for plan in strategy.compression_plans()]

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % GAN_EVERY == 0:
                plans = strategy.compression_plans()
                intervals.append({
                    "generation": cdo.generation,
                    "plans": [[[e.name, list(e.shape), e.label, e.critical]
                               for e in plan.entries] for plan in plans],
                    "predicted": [s for _, _, s in running],
                    "timed": [lay.steps[key][0] if key in lay.steps else None
                              for lay, key, _ in running],
                    "shared": [plan.pace.shared_s if plan.pace is not None else None
                               for plan in plans]})

    data = data_lib.make_tf_dataset(real, noise, 8, shuffle=False, workers=num_workers)
    history = model.fit(
        data, epochs=1, steps_per_epoch=GAN_STEPS, verbose=0,
        callbacks=[tfgc.keras.AutoPlanCallback(strategy, every_steps=GAN_EVERY), Plans()])
    shown = [[e.name, list(e.shape), e.label] for e in strategy.compression_plan().entries]
    # Both optimizers' checkpoint, restored into a new GAN under the compressor set
    # afresh and the callback again (the low-rank errors come back with regimes
    # tracked): its first step takes both plans back without measuring.
    saved = [plan.key() for plan in strategy.compression_plans()]
    path = tf.train.Checkpoint(d_opt=model.d_opt, g_opt=model.g_opt).save(
        os.path.join(out_dir, f"gan_ckpt.w{rank}", "ckpt"))
    measured = cdo._auto.measurements  # pylint: disable=protected-access
    strategy.compressor = "auto:link_gbps=0.001"
    with strategy.scope():
        keras.utils.set_random_seed(3)
        again = Gan()
        again.compile()
    tf.train.Checkpoint(d_opt=again.d_opt, g_opt=again.g_opt).restore(path)
    again.fit(data, epochs=1, steps_per_epoch=1, verbose=0,
              callbacks=[tfgc.keras.AutoPlanCallback(strategy, every_steps=GAN_EVERY)])
    restored = [plan.key() for plan in strategy.compression_plans()]
    # Pinned by hand: every gradient of both sets as bf16 (the slow link's plans are
    # not), two steps and their bytes, then given back for a step.
    # Choices that differ between the workers, or that one worker refuses: every
    # worker stops with a ValueError, and nothing is pinned.
    refusals = []
    for mine in (["bf16", "rqsgd4"], ["bf16", "bf17"]):
        try:
            cdo.pin_plan(mine[rank])
            refusals.append(None)
        except ValueError as exc:
            refusals.append(str(exc))
    generation = cdo.generation
    pinned = {"changed": cdo.pin_plan(GAN_PIN)}
    before = strategy.compression_stats()
    again.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    after = strategy.compression_stats()
    plans = strategy.compression_plans()
    planned = sum(int(np.prod(e.shape)) for plan in plans for e in plan.entries)
    pinned.update(
        generations=cdo.generation - generation,
        plans=[[[e.name, e.label, e.reason, e.sent_bytes] for e in plan.entries]
               for plan in plans],
        digests=[plan.digest() for plan in plans],
        keys=[plan.key() for plan in plans],
        sent=(after["total_sent_bytes"] - before["total_sent_bytes"]) / 2,
        reductions=after["steps"] - before["steps"],
        unplanned=int(sum(np.prod(v.shape) for v in again.trainable_variables)) - planned)
    pinned["released"] = cdo.pin_plan(None)
    again.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
    pinned["given_back"] = [[plan.key(), [e.reason for e in plan.entries]]
                            for plan in strategy.compression_plans()]
    np.savez(os.path.join(out_dir, f"gan.w{rank}.npz"),
             **{f"w{i}": w.numpy() for i, w in enumerate(model.weights)})
    with open(os.path.join(out_dir, f"gan.w{rank}.json"), "w") as f:
        json.dump({"intervals": intervals, "pinned": pinned, "refusals": refusals,
                   "losses": {k: [float(v) for v in vs] for k, vs in history.history.items()},
                   "shown": shown, "saved": saved,
                   "restored": restored,
                   "measurements": [measured,
                                    cdo._auto.measurements]}, f)  # pylint: disable=protected-access


# The bag of embeddings: its table, tokens a sequence, steps and the callback's interval.
BAG_TABLE, BAG_TOKENS, BAG_STEPS, BAG_EVERY = (1000, 32), 16, 12, 3


def build_bag(strategy):
    """The bag of embeddings (``BAG_TABLE``, ``BAG_TOKENS`` tokens a row, a head of 4
    below the policy's size), compiled under ``strategy``; tests/test_auto.py fits it
    in one process too."""
    import tf_keras as keras

    with strategy.scope():
        keras.utils.set_random_seed(5)
        net = keras.Sequential([keras.Input((BAG_TOKENS,), dtype="int32"),
                                keras.layers.Embedding(*BAG_TABLE, name="bag"),
                                keras.layers.GlobalAveragePooling1D(),
                                keras.layers.Dense(4, name="head")])
        net.compile(optimizer=keras.optimizers.SGD(0.05),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return net


def bag(strategy, rank, out_dir):
    """Step 13 of the module docstring."""
    import tensorflow as tf
    import tf_keras as keras

    import tfgc

    strategy.compressor = "auto:link_gbps=0.001"
    rng = np.random.RandomState(11 + rank)
    x = rng.randint(BAG_TABLE[0], size=(BAG_STEPS * 8, BAG_TOKENS)).astype(np.int32)
    y = (x[:, 0] % 4).astype(np.int32)
    net = build_bag(strategy)
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=BAG_EVERY, link_margin=None)
    first = {}

    class First(keras.callbacks.Callback):
        """The first step's plans and the gradients it sent as they are."""

        def on_train_batch_end(self, batch, logs=None):
            if not first:
                first.update(plans=[[plan.key(), [dataclasses.asdict(t) for t in plan.tables]]
                                    for plan in strategy.compression_plans()],
                             uncompressed=strategy.uncompressed_gradients())

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    before = strategy.compression_stats()
    history = net.fit(data.with_options(options), epochs=1, steps_per_epoch=BAG_STEPS,
                      verbose=0, callbacks=[callback, First()])
    after = strategy.compression_stats()
    np.savez(os.path.join(out_dir, f"bag.w{rank}.npz"), *[w.numpy() for w in net.weights])
    with open(os.path.join(out_dir, f"bag.w{rank}.json"), "w") as f:
        json.dump({"first": first,
                   "plans": [[plan.key(), [dataclasses.asdict(t) for t in plan.tables]]
                             for plan in strategy.compression_plans()],
                   "uncompressed": strategy.uncompressed_gradients(),
                   "steps": after["steps"] - before["steps"],
                   "nonfinite": after["nonfinite_steps"] - before["nonfinite_steps"],
                   "losses": [float(v) for v in history.history["loss"]]}, f)


if __name__ == "__main__":
    main()
