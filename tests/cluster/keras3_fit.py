"""A cluster worker for tests/test_keras3.py: Keras 3's model.fit under tfgc's strategy.

Keras 3 (``import keras``, TensorFlow backend), not tf-keras. Three runs on MNIST-5k
with the MLP of the other distributed tests (784-256-128-10), one strategy whose
compressor is switched between them:

* ``none``: plain SGD on unshuffled shards, with what each step fed this worker
  recorded, so that the test can replay the run in one process;
* ``ef+topk:ratio=0.01`` with momentum, ``jit_compile=True`` (which the strategy turns
  off: its kernels have no XLA form), ``CompressionStatsCallback`` and
  ``model.evaluate``; then a checkpoint round trip of the compressor state;
* ``qsgd``: the quantized all-gather path;
* ``auto`` on a 10 Mbit/s link with ``AutoPlanCallback``: regimes, low rank measured
  after the first step, a change of plan priced;
* ``qsgd`` under ``mixed_float16``, worker 1's gradients overflowing at one step;
* every other compressor but variance-based for a few steps;
* then, given ``--user-models ARGS...``, tests/cluster/user_models.py's runs with those
  arguments (``--keras 3`` added) into OUT_DIR/user_models, on a second strategy in the
  same processes: one Keras 3 cluster serves both modules' tests.

Writes OUT_DIR/<name>.w<rank>.npz (weights; for ``none`` also the initial weights
and the recorded batches) and OUT_DIR/<name>.w<rank>.json (sweep.w<rank>.json for the
sweep, with per-weight checksums).
"""

import json
import os
import sys

import numpy as np

STEPS_NONE = 12
# The compressors not trained above (variance-based needs tf-keras layers; scaledsign
# requires error feedback, so the registry builds it as efsignsgd).
SWEEP = ["adaptive", "bf16", "dgc:ratio=0.01,warmup_steps=2", "efsignsgd", "fft", "fp16",
         "graddrop", "gradiveq", "importance", "onebit", "powersgd", "randomk",
         "signsgd", "terngrad", "threshold"]
SWEEP_STEPS = 6
# auto with AutoPlanCallback: intervals of AUTO_EVERY steps.
AUTO_STEPS, AUTO_EVERY = 12, 4
# mixed_float16: steps, and the one at which worker 1's gradients overflow.
MIXED_STEPS, OVERFLOW_STEP = 6, 2
BATCH = 64  # per worker; the strategy splits it between the replicas of the cluster


def build(keras, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def save(out_dir, name, rank, results, arrays=None):
    if arrays is not None:
        np.savez(os.path.join(out_dir, f"{name}.w{rank}.npz"), **arrays)
    with open(os.path.join(out_dir, f"{name}.w{rank}.json"), "w") as f:
        json.dump(results, f)


def plain_fit(strategy, keras, loss, seed, data, steps):
    """A fresh MLP under plain SGD fitted for ``steps``: the model, its history and the
    strategy's figures before and after."""
    with strategy.scope():
        model = build(keras, seed=seed)
        model.compile(optimizer=keras.optimizers.SGD(0.02), loss=loss)
    before = strategy.compression_stats()
    history = model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    return model, history, before, strategy.compression_stats()


def weights(model):
    return {f"w{i}": w.numpy() for i, w in enumerate(model.weights)}


def main(out_dir):
    import keras
    import tensorflow as tf

    import tfgc
    from tfgc.apps import data as data_lib

    assert int(keras.__version__.split(".")[0]) >= 3, keras.__version__
    ds = data_lib.load_dataset("mnist5k", seed=0)
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy("none")
    rank, n = strategy.worker_index, strategy.num_replicas_in_sync
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, n)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # --- none: plain SGD, unshuffled, every fed batch recorded -------------------
    train = data_lib.make_tf_dataset(x, y, BATCH, shuffle=False, repeat=True)
    with strategy.scope():
        model = build(keras, seed=3)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    initial = weights(model)
    history = model.fit(train, epochs=1, steps_per_epoch=STEPS_NONE, verbose=0)
    # A fresh iterator over the same unshuffled data yields what fit consumed.
    fed = iter(strategy.experimental_distribute_dataset(train))
    batches = {}
    for step in range(STEPS_NONE):
        xb, yb = next(fed)
        batches[f"x{step}"] = strategy.experimental_local_results(xb)[0].numpy()
        batches[f"y{step}"] = strategy.experimental_local_results(yb)[0].numpy()
    stats = strategy.compression_stats()
    save(out_dir, "none", rank,
         {"loss": history.history["loss"], "stats": stats, "num_workers": n,
          "state_slots": strategy.compression_state(model.optimizer).num_slots()},
         {**weights(model), **{f"init_{k}": v for k, v in initial.items()}, **batches})

    # --- ef+topk: momentum, jit_compile asked for, stats callback, evaluate ---------
    strategy.compressor = "ef+topk:ratio=0.01"
    train = data_lib.make_tf_dataset(x, y, BATCH, seed=rank, repeat=False)
    test = data_lib.make_tf_dataset(ds.x_test, ds.y_test, 256, shuffle=False,
                                    drop_remainder=False)
    with strategy.scope():
        model = build(keras, seed=4)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss,
                      metrics=["accuracy"], jit_compile=True)
    callback = tfgc.keras.CompressionStatsCallback(strategy)
    before = strategy.compression_stats()
    history = model.fit(train, epochs=2, verbose=0, callbacks=[callback])
    after = strategy.compression_stats()
    evaluated = model.evaluate(test, verbose=0, return_dict=True)
    state = strategy.compression_state(model.optimizer)
    norms = state.residual_norms()
    scalars = callback.scalars()
    checkpoint = tf.train.Checkpoint(optimizer=model.optimizer)
    path = checkpoint.write(os.path.join(out_dir, f"ckpt.w{rank}", "state"))
    state.reset()
    zeroed = state.residual_norms()
    checkpoint.read(path).assert_existing_objects_matched()
    restored = state.residual_norms()
    save(out_dir, "eftopk", rank,
         {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "stats": after, "reductions": after["steps"] - before["steps"],
          "evaluate": {k: float(v) for k, v in evaluated.items()},
          "jit_compile": bool(model.jit_compile), "norms": norms, "zeroed": zeroed,
          "restored": restored, "state_slots": state.num_slots(), "scalars": scalars},
         weights(model))

    # --- qsgd: the quantized all-gather ------------------------------------------
    strategy.compressor = "qsgd"
    with strategy.scope():
        model = build(keras, seed=5)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss,
                      metrics=["accuracy"])
    before = strategy.compression_stats()
    model.fit(train, epochs=1, verbose=0)
    after = strategy.compression_stats()
    evaluated = model.evaluate(test, verbose=0, return_dict=True)
    save(out_dir, "qsgd", rank,
         {"stats": after, "reductions": after["steps"] - before["steps"],
          "evaluate": {k: float(v) for k, v in evaluated.items()}},
         weights(model))
    # --- auto with AutoPlanCallback: regimes, low rank measured, changes priced ----
    strategy.compressor = "auto:link_gbps=0.01"
    with strategy.scope():
        model = build(keras, seed=7)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)
    plans = []

    class Plans(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # the next step's plan
            plan = strategy.compression_plan()
            plans.append(None if plan is None else
                         [[e.name, e.label, bool(e.critical)] for e in plan.entries])

    class Stop(keras.callbacks.Callback):
        # The first AUTO_STEPS of a long training: the low-rank candidates' timing pays
        # over the steps it has left, as it would not over a fit of AUTO_STEPS. Long
        # enough for it to pay on machines of this class that run the step several
        # times slower than others (under a fit of 100 * AUTO_STEPS, one that ran the
        # benchmarks' steps 3-4 times slower planned no low rank until the second
        # interval).
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 >= AUTO_STEPS:
                self.model.stop_training = True

    auto_callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=AUTO_EVERY)
    history = model.fit(train, epochs=1, steps_per_epoch=1000 * AUTO_STEPS, verbose=0,
                        callbacks=[auto_callback, Plans(), Stop()])
    save(out_dir, "auto", rank,
         {"loss": [float(v) for v in history.history["loss"]], "plans": plans,
          "intervals": [[epoch, list(critical), replanned]
                        for epoch, critical, replanned in auto_callback.history],
          "change_s": auto_callback.change_s},
         weights(model))

    # --- mixed_float16: one worker's gradients overflow at one step ------------------
    # Keras 3's loss scaling decides from each worker's own gradients, before they are
    # all-reduced: without the workers agreeing first, worker 1 would skip the step's
    # all-reduce that worker 0 enters, and both would wait for ever.
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy.compressor = "qsgd"
    xs, ys = x[:MIXED_STEPS * BATCH].copy(), y[:MIXED_STEPS * BATCH]
    if rank == 1:
        xs[OVERFLOW_STEP * BATCH:(OVERFLOW_STEP + 1) * BATCH] *= 1e6  # inf in float16
    # Step k puts rows [k BATCH, (k + 1) BATCH) of this worker's data through its model.
    train_mixed = data_lib.make_tf_dataset(xs, ys, BATCH, shuffle=False, repeat=True,
                                           workers=n)
    model, history, before, after = plain_fit(strategy, keras, loss, 8, train_mixed,
                                              MIXED_STEPS)
    save(out_dir, "mixed", rank,
         {"loss": [float(v) for v in history.history["loss"]],
          "policy": model.dtype_policy.name,
          "optimizer": type(model.optimizer).__name__,
          "scale": float(model.optimizer.dynamic_scale.numpy()),
          "steps": after["steps"] - before["steps"],
          "nonfinite_steps": after["nonfinite_steps"] - before["nonfinite_steps"]},
         weights(model))
    keras.mixed_precision.set_global_policy("float32")

    # --- every other compressor, briefly (plain SGD: DGC brings its own momentum) ---
    sweep = {}
    for spec in SWEEP:
        strategy.compressor = spec
        model, history, before, after = plain_fit(strategy, keras, loss, 6, train,
                                                  SWEEP_STEPS)
        sweep[spec] = {"loss": float(history.history["loss"][0]),
                       "reductions": after["steps"] - before["steps"],
                       "payload_bytes": after["payload_bytes"],
                       "checksum": [float(np.sum(np.abs(w.numpy()), dtype=np.float64))
                                    for w in model.weights]}
    save(out_dir, "sweep", rank, sweep)
    print("keras3 runs done", flush=True)


def user_models(out_dir, args):
    """tests/cluster/user_models.py's runs under Keras 3, into OUT_DIR/user_models (this
    script's directory is on ``sys.path``, as for any script run by path)."""
    import user_models as runs

    out = os.path.join(out_dir, "user_models")
    os.makedirs(out, exist_ok=True)
    runs.main([out, "--keras", "3", *args])


if __name__ == "__main__":
    # Keras 3 for tf.keras too, whatever tfgc would default to. Set here, not at
    # import, so that the test can import build() without changing its process.
    os.environ["TF_USE_LEGACY_KERAS"] = "0"
    main(sys.argv[1])
    if "--user-models" in sys.argv:
        user_models(sys.argv[1], sys.argv[sys.argv.index("--user-models") + 1:])
