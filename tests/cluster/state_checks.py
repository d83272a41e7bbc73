"""A cluster worker for the compression-state tests: one launch, many checks.

Each check trains small MLPs on MNIST-5k with deterministic per-worker batches and
writes what it saw to OUT_DIR/<check>.w<rank>.json (and .npz for arrays); the test
module compares workers and asserts. Checks:

* ``exact``: a user's replica-context all_reduce and strategy.reduce are exact and
  are not counted as training steps;
* ``nonfinite``: with a LossScaleOptimizer, a step in which one worker's gradients
  hold a NaN leaves every compressor's state bit for bit as it was, on every
  worker, the step is skipped, and training goes on;
* ``checkpoint``: a checkpoint of worker 0, restored into a fresh model and
  optimizer on every worker before its first step, gives each worker its own
  residuals back: one more step then matches an uninterrupted run bit for bit;
* ``restore_elsewhere`` (run alone, ``--checkpoint``): a checkpoint written by a
  cluster of another size is restored with each residual's total kept;
* ``two_models``: a second model with the same shapes trained in between does
  not change the first one's training;
* ``switch``: switching compressor from a callback takes effect at the next batch;
* ``switch_state``: switches inside one fit from DGC (a residual and a momentum) to
  gradient dropping (a residual) to QSGD (none): the residual travels on, the momentum
  is dropped with a warning that names it;
* ``dtypes``: float64 gradients go dense (no crash), embedding gradients
  (IndexedSlices) are counted;
* ``stale``: a tf.function traced before a switch fails with a clear message.
"""

import argparse
import gc
import json
import os

import numpy as np

BATCH = 32


def save(out_dir, name, rank, results, arrays=None):
    if arrays is not None:
        np.savez(os.path.join(out_dir, f"{name}.w{rank}.npz"), **arrays)
    with open(os.path.join(out_dir, f"{name}.w{rank}.json"), "w") as f:
        json.dump(results, f)


class Setup:
    def __init__(self, strategy, ds):
        from tfgc.apps.train import worker_info
        self.strategy = strategy
        self.rank, self.n = worker_info(strategy)
        self.x, self.y = ds.x_train, ds.y_train

    def batch(self, step, rank=None):
        """Worker ``rank``'s batch number ``step``: fixed, so any run can replay it."""
        rank = self.rank if rank is None else rank
        start = ((step * self.n + rank) * BATCH) % (len(self.x) - BATCH)
        return self.x[start:start + BATCH], self.y[start:start + BATCH]

    def model(self, seed, optimizer=None, loss_scale=False):
        import tf_keras as keras

        from tfgc.apps import models
        with self.strategy.scope():
            net = models.build_model("mlp", seed=seed)
            opt = optimizer or keras.optimizers.SGD(0.05, momentum=0.9)
            if loss_scale:
                opt = keras.mixed_precision.LossScaleOptimizer(opt)
            net.build((None, 28, 28, 1))
        return net, opt

    def fit(self, net, opt, steps, callback):
        """Compiles ``net`` with ``opt`` and fits it ``steps`` steps on this worker's
        shard of the training set, ``callback`` seeing every batch; the History."""
        import tf_keras as keras

        from tfgc.apps import data as data_lib
        with self.strategy.scope():
            net.compile(optimizer=opt,
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = data_lib.shard(self.x, self.y, self.rank, self.n)
        train = data_lib.make_tf_dataset(x, y, BATCH, repeat=True)
        return net.fit(train, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[callback])

    def train_step(self, net, opt):
        """A tf.function running one custom-loop step on the given per-worker batch."""
        import tensorflow as tf
        import tf_keras as keras
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        scaled = isinstance(opt, keras.mixed_precision.LossScaleOptimizer)
        global_batch = BATCH * self.n

        @tf.function
        def step(x, y):
            def replica_fn(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(y, net(x, training=True)),
                                                      global_batch_size=global_batch)
                    target = opt.get_scaled_loss(loss) if scaled else loss
                grads = tape.gradient(target, net.trainable_variables)
                if scaled:
                    grads = opt.get_unscaled_gradients(grads)
                opt.apply_gradients(zip(grads, net.trainable_variables))
                return loss
            return self.strategy.run(replica_fn, args=(x, y))
        return step

    def state_arrays(self, opt, prefix=""):
        import tf_keras as keras
        inner = opt.inner_optimizer if isinstance(opt, keras.mixed_precision.LossScaleOptimizer) \
            else opt
        state = self.strategy.compression_state(inner)
        return {f"{prefix}{i}": v.numpy() for i, v in enumerate(state.variables())}


def check_exact(s, out_dir):
    import tensorflow as tf
    strategy = s.strategy
    strategy.compressor = "topk:ratio=0.01"
    before = strategy.compression_stats()["steps"]

    def local_value(rank):
        return np.random.RandomState(100 + rank).randn(64, 64).astype(np.float32)

    @tf.function
    def user_all_reduce(x):
        # The value is computed inside the replica function, so it sits on the
        # replica's device, as a user's statistics or gradients would.
        return strategy.run(
            lambda v: tf.distribute.get_replica_context().all_reduce("sum", v * 1.0), args=(x,))

    replica_sum = strategy.experimental_local_results(
        user_all_reduce(tf.constant(local_value(s.rank))))[0].numpy()
    per_replica = strategy.run(lambda: tf.constant(local_value(s.rank)))
    reduced = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None).numpy()
    expected = sum(local_value(r).astype(np.float64) for r in range(s.n))
    save(out_dir, "exact", s.rank, {
        "steps_counted": strategy.compression_stats()["steps"] - before,
        "replica_sum_nonzeros": int(np.count_nonzero(replica_sum)),
        "replica_sum_err": float(np.max(np.abs(replica_sum - expected))),
        "reduce_err": float(np.max(np.abs(reduced - expected)))})


def check_nonfinite(s, out_dir, specs):
    import tensorflow as tf
    strategy = s.strategy
    results, arrays = {}, {}
    for spec in specs:
        strategy.compressor = spec
        net, opt = s.model(seed=3, loss_scale=True)
        step = s.train_step(net, opt)
        for i in range(3):
            step(*s.batch(i))
        state_before = s.state_arrays(opt)
        weights_before = [w.numpy() for w in net.trainable_variables]
        scale_before = float(opt.loss_scale)
        skipped_before = strategy.compression_stats()["nonfinite_steps"]
        x, y = s.batch(3)
        if s.rank == s.n - 1:
            x = x.copy()
            x[0, 10, 10, 0] = np.nan
        step(tf.constant(x), tf.constant(y))
        state_after = s.state_arrays(opt)
        weights_after = [w.numpy() for w in net.trainable_variables]
        results[spec] = {
            "state_unchanged": all(np.array_equal(state_before[k], state_after[k], equal_nan=True)
                                   for k in state_before),
            "state_fields": len(state_before),
            "state_finite": all(bool(np.all(np.isfinite(v))) for v in state_after.values()
                                if v.dtype.kind == "f"),
            "weights_unchanged": all(np.array_equal(a, b)
                                     for a, b in zip(weights_before, weights_after)),
            "scale_before": scale_before, "scale_after": float(opt.loss_scale),
            "skipped": strategy.compression_stats()["nonfinite_steps"] - skipped_before,
        }
        for i in range(4, 7):
            step(*s.batch(i))
        final = [w.numpy() for w in net.trainable_variables]
        results[spec]["finite_after"] = all(bool(np.all(np.isfinite(w))) for w in final)
        results[spec]["state_finite_after"] = all(
            bool(np.all(np.isfinite(v))) for v in s.state_arrays(opt).values() if v.dtype.kind == "f")
        for j, w in enumerate(final):
            arrays[f"{spec}/{j}"] = w
    save(out_dir, "nonfinite", s.rank, results, arrays)


def check_checkpoint(s, out_dir):
    import tensorflow as tf
    strategy = s.strategy
    strategy.compressor = "ef+topk:ratio=0.01"
    net, opt = s.model(seed=5)
    step = s.train_step(net, opt)
    for i in range(5):
        step(*s.batch(i))
    ckpt = tf.train.Checkpoint(model=net, optimizer=opt)
    # Every worker saves (as Keras callbacks do); only worker 0's copy is read back.
    path = ckpt.write(os.path.join(out_dir, f"ckpt_w{s.rank}", "state"))
    norms_saved = strategy.compression_state(opt).residual_norms()
    np.savez(os.path.join(out_dir, f"checkpoint_saved.w{s.rank}.npz"), **s.state_arrays(opt))
    step(*s.batch(5))
    uninterrupted = {"w": [w.numpy() for w in net.trainable_variables],
                     "state": s.state_arrays(opt)}

    fresh, fresh_opt = s.model(seed=6)
    worker0_path = path.replace(f"ckpt_w{s.rank}", "ckpt_w0")
    tf.train.Checkpoint(model=fresh, optimizer=fresh_opt).read(worker0_path)
    had_state_before_first_step = strategy.compression_state(fresh_opt) is not None
    fresh_step = s.train_step(fresh, fresh_opt)
    fresh_step(*s.batch(5))
    resumed = {"w": [w.numpy() for w in fresh.trainable_variables],
               "state": s.state_arrays(fresh_opt)}
    same_weights = all(np.array_equal(a, b) for a, b in zip(uninterrupted["w"], resumed["w"]))
    same_state = sorted(uninterrupted["state"]) == sorted(resumed["state"]) and all(
        np.array_equal(uninterrupted["state"][k], resumed["state"][k])
        for k in uninterrupted["state"])
    save(out_dir, "checkpoint", s.rank, {
        "deferred": not had_state_before_first_step,
        "same_weights": same_weights, "same_state": same_state,
        "norms_saved": norms_saved,
        "norms_resumed": strategy.compression_state(fresh_opt).residual_norms()},
        {k: v for k, v in uninterrupted["state"].items()})


def check_restore_elsewhere(s, out_dir, checkpoint):
    """Restores a checkpoint written by a cluster of another size, before the first step."""
    import tensorflow as tf
    strategy = s.strategy
    strategy.compressor = "ef+topk:ratio=0.01"
    net, opt = s.model(seed=6)
    tf.train.Checkpoint(model=net, optimizer=opt).read(checkpoint)
    s.train_step(net, opt)(*s.batch(0))
    state = strategy.compression_state(opt)
    save(out_dir, "restore_elsewhere", s.rank, {"restored_norms": state.last_restore,
                                                "step": int(state.step(0).numpy())})


def check_two_models(s, out_dir):
    strategy = s.strategy
    strategy.compressor = "ef+randomk:ratio=0.05"
    a, opt_a = s.model(seed=7)
    b, opt_b = s.model(seed=8)
    ref, opt_ref = s.model(seed=7)
    step_a, step_b, step_ref = s.train_step(a, opt_a), s.train_step(b, opt_b), s.train_step(ref, opt_ref)
    for i in range(3):
        step_a(*s.batch(i))
    for i in range(3):
        step_b(*s.batch(i + 10))
    for i in range(3, 6):
        step_a(*s.batch(i))
    for i in range(6):
        step_ref(*s.batch(i))
    states = {id(strategy.compression_state(o)) for o in (opt_a, opt_b, opt_ref)}
    changed = not all(np.array_equal(x.numpy(), y.numpy())
                      for x, y in zip(a.trainable_variables, b.trainable_variables))
    # The state goes with its optimizer: dropping model b frees b's state.
    live_before = len(strategy.compression_state())
    del b, opt_b, step_b
    gc.collect()
    live_after = len(strategy.compression_state())
    save(out_dir, "two_models", s.rank, {
        "live_states": [live_before, live_after],
        "identical_to_alone": all(np.array_equal(x.numpy(), y.numpy())
                                  for x, y in zip(a.trainable_variables, ref.trainable_variables)),
        "changed": changed,
        "distinct_states": len(states)})


def check_switch(s, out_dir):
    import tf_keras as keras

    strategy = s.strategy
    strategy.compressor = "none"
    net, opt = s.model(seed=9)
    payloads = []

    class Switch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            payloads.append(strategy.compression_stats()["payload_bytes"])
            if batch == 3:
                strategy.compressor = "topk:ratio=0.01"

    s.fit(net, opt, 8, Switch())
    dense = sum(int(np.prod(v.shape)) * 4 for v in net.trainable_variables)
    save(out_dir, "switch", s.rank, {"payloads": payloads, "dense": dense})


# switch_state: the compressor after each of these batches (plain SGD: DGC applies its
# own momentum on the workers). DGC keeps a residual and a momentum, gradient dropping
# only a residual, QSGD neither.
SWITCH_STATE = {2: "dgc:ratio=0.01", 5: "graddrop", 8: "qsgd"}
SWITCH_STATE_STEPS = 12


def check_switch_state(s, out_dir):
    import logging

    import tf_keras as keras

    strategy = s.strategy
    strategy.compressor = "none"
    net, opt = s.model(seed=13, optimizer=keras.optimizers.SGD(0.05))
    payloads, fields, carried, warnings = [], [], [], []

    class Warnings(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append([len(payloads), record.getMessage()])

    class Switch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            payloads.append(strategy.compression_stats()["payload_bytes"])
            state = strategy.compression_state(opt)
            norms = state.residual_norms() if state is not None else {}
            # The state fields this batch's step left, by name, and the norm of what is
            # kept apart for each variable (None: nothing is).
            fields.append(sorted({k.rsplit("/", 1)[1] for k in norms}))
            held = [state.carried(v, 0) if state is not None else None
                    for v in net.trainable_variables]
            carried.append([None if c is None else float(np.linalg.norm(c.numpy()))
                            for c in held])
            if batch in SWITCH_STATE:
                strategy.compressor = SWITCH_STATE[batch]

    handler = Warnings()
    logging.getLogger("absl").addHandler(handler)
    try:
        before = strategy.compression_stats()["steps"]
        history = s.fit(net, opt, SWITCH_STATE_STEPS, Switch())
    finally:
        logging.getLogger("absl").removeHandler(handler)
    dense = sum(int(np.prod(v.shape)) * 4 for v in net.trainable_variables)
    save(out_dir, "switch_state", s.rank, {
        "payloads": payloads, "dense": dense, "fields": fields, "carried": carried,
        "warnings": warnings, "loss": [float(v) for v in history.history["loss"]],
        "steps": strategy.compression_stats()["steps"] - before},
        {str(i): w.numpy() for i, w in enumerate(net.trainable_variables)})


def check_dtypes(s, out_dir):
    import tensorflow as tf
    import tf_keras as keras
    strategy = s.strategy
    strategy.compressor = "ef+topk:ratio=0.01"
    results = {}
    with strategy.scope():
        net64 = keras.Sequential([keras.layers.Dense(64, dtype="float64", input_shape=(100,)),
                                  keras.layers.Dense(10, dtype="float64")])
        opt64 = keras.optimizers.SGD(0.1)
    before = strategy.compression_stats()["steps"]
    step = s.train_step(net64, opt64)
    rng = np.random.RandomState(s.rank)
    for _ in range(2):
        step(tf.constant(rng.randn(BATCH, 100)), tf.constant(rng.randint(0, 10, BATCH)))
    stats = strategy.compression_stats()
    results["float64_steps"] = stats["steps"] - before
    results["float64_payload"] = stats["payload_bytes"]
    results["float64_dense"] = stats["dense_bytes"]
    results["float64_weights"] = [w.numpy().tolist() for w in net64.trainable_variables[1:]]

    with strategy.scope():
        emb = keras.Sequential([keras.layers.Embedding(1000, 16, input_length=8),
                                keras.layers.Flatten(), keras.layers.Dense(10)])
        opt_emb = keras.optimizers.SGD(0.1)
    step = s.train_step(emb, opt_emb)
    step(tf.constant(rng.randint(0, 1000, (BATCH, 8))), tf.constant(rng.randint(0, 10, BATCH)))
    stats = strategy.compression_stats()
    results["embedding"] = {k: stats[k] for k in ("dense_bytes", "payload_bytes", "sent_bytes")}
    save(out_dir, "dtypes", s.rank, results)


def check_stale(s, out_dir):
    import tensorflow as tf
    strategy = s.strategy
    strategy.compressor = "topk:ratio=0.01"
    net, opt = s.model(seed=11)
    step = s.train_step(net, opt)
    step(*s.batch(0))
    strategy.compressor = "qsgd"
    message = ""
    try:
        step(*s.batch(1))
    except tf.errors.InvalidArgumentError as e:
        message = e.message
    save(out_dir, "stale", s.rank, {"message": message})


CHECKS = ("exact", "nonfinite", "checkpoint", "two_models", "switch", "switch_state", "dtypes",
          "stale")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--checks", nargs="*", default=list(CHECKS))
    parser.add_argument("--checkpoint", help="for restore_elsewhere: the checkpoint to read")
    parser.add_argument("--nonfinite-specs", nargs="*",
                        default=["ef+topk:ratio=0.01", "onebit", "efsignsgd", "randomk:ratio=0.05"])
    args = parser.parse_args()

    import tfgc
    from tfgc.apps import data as data_lib

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy()
    s = Setup(strategy, data_lib.load_dataset("mnist5k", seed=0))
    for name in args.checks:
        if name == "nonfinite":
            check_nonfinite(s, args.out_dir, args.nonfinite_specs)
        elif name == "restore_elsewhere":
            check_restore_elsewhere(s, args.out_dir, args.checkpoint)
        else:
            globals()[f"check_{name}"](s, args.out_dir)
        print(f"done {name}", flush=True)


if __name__ == "__main__":
    main()
