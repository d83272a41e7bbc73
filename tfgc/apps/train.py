"""``tfgc-train``: train a model with compressed gradients on a local or TF_CONFIG cluster.

    tfgc-train --workers 2 --dataset fashion_mnist --model mlp --compressor "ef+topk:ratio=0.01"
    tfgc-train --workers 2 --dataset fashion_mnist --model mlp --baseline
    tfgc-train --workers 4 --lr_scaling linear --warmup_epochs 1 --learning_rate 0.05

With ``--workers N`` (N > 1) and no ``TF_CONFIG`` in the environment, it starts a
local cluster of N copies of itself through ``tfgc-launch``; with ``TF_CONFIG`` set it
runs as that one worker. Worker 0 prints test accuracy, bytes per step, compression
ratio and step time, and a final ``RESULT {json}`` line.

``--lr_scaling linear`` trains at N times ``--learning_rate`` on N workers, after an
optional gradual warm-up (Goyal et al. 2017; see ``tfgc.keras.LinearScalingWarmup``).
"""

import json
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS


def _builtin(module, names):
    """tfgc.apps.<module>.<names>: the built-in models or data sets (no TensorFlow import)."""
    import importlib
    return getattr(importlib.import_module(f"tfgc.apps.{module}"), names)


def _is_entry_point(value):
    from tfgc.apps.entry_points import is_entry_point
    return is_entry_point(value)


flags.DEFINE_string("compressor", "ef+topk:ratio=0.01",
                    "Compressor spec, e.g. 'none', 'qsgd:levels=7', 'ef+topk:ratio=0.001'.")
flags.DEFINE_string("model", "mlp", "Model to train: 'mlp', 'cnn', or your own as "
                    "package.module:build_fn, called as build_fn(input_shape, num_classes, seed) "
                    "and returning an uncompiled tf_keras.Model (see tfgc.apps.entry_points).")
flags.DEFINE_string("dataset", "fashion_mnist", "Data set: 'fashion_mnist', 'mnist5k', "
                    "'synthetic', or your own as package.module:load_fn, called as "
                    "load_fn(seed) and returning ((x_train, y_train), (x_test, y_test)) or a "
                    "tfgc.apps.data.Dataset; each worker trains on its own shard.")
flags.DEFINE_integer("epochs", 2, "Epochs over each worker's shard.", lower_bound=1)
flags.DEFINE_integer("batch_size", 64, "Batch size per worker.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.05, "Learning rate (with --lr_scaling=linear: the rate "
                   "for one worker's batch, before scaling).", lower_bound=0.0)
flags.DEFINE_enum("lr_scaling", "none", ["none", "linear"],
                  "How the learning rate follows the worker count N. 'none': --learning_rate "
                  "as given. 'linear': the linear scaling rule of Goyal et al. 2017 (the "
                  "global batch is N x --batch_size, so train at N x --learning_rate), reached "
                  "by a linear warm-up from --learning_rate over --warmup_epochs.")
flags.DEFINE_float("warmup_epochs", 0.0, "Epochs (of --steps_per_epoch steps, or a full shard) "
                   "of linear learning-rate warm-up. With --lr_scaling=linear the rate ramps "
                   "from --learning_rate to N x --learning_rate (Goyal et al. use 5); with "
                   "--schedule=cosine and no scaling, from a tenth of the rate to the rate. "
                   "Must be 0 with --lr_scaling=none and --schedule=constant.",
                   lower_bound=0.0)
flags.DEFINE_enum("schedule", "constant", ["constant", "cosine"],
                  "Learning rate after warm-up: 'constant', or 'cosine' decay to 0 at the end "
                  "of the run (Loshchilov & Hutter 2017).")
flags.DEFINE_bool("recommended", False,
                  "Train with the compressor's recommended setting "
                  "(tfgc.compressors.recommended, listed in the README): its compressor "
                  "string when --compressor names only the compressor, its optimizer, "
                  "--learning_rate times its rate scale, its schedule and warm-up, and "
                  "--epochs (the dense run's) times its epochs scale. Flags given on the "
                  "command line win. With --baseline: the dense setting.")
flags.DEFINE_enum("optimizer", "momentum", ["sgd", "momentum", "adam"],
                  "Optimizer. 'momentum' is SGD with momentum 0.9, or plain SGD when the "
                  "compressor applies the momentum itself (dgc, or momentum=m on an "
                  "error-feedback compressor such as onebit:momentum=0.9).")
flags.DEFINE_integer("workers", 1, "Workers to launch locally when TF_CONFIG is not set.",
                     lower_bound=1)
flags.DEFINE_bool("baseline", False, "Use stock tf.distribute.MultiWorkerMirroredStrategy.")
flags.DEFINE_integer("seed", 0, "Seed for weights, data order and compressors.")
flags.DEFINE_integer("min_elements", 1024, "Gradients with fewer elements are sent dense.",
                     lower_bound=0)
flags.DEFINE_enum("communication", "auto",
                  ["auto", "allreduce", "allgather", "reduce_scatter", "shared_index",
                   "sparse_allreduce", "low_rank"],
                  "How compressed payloads cross the wire (auto: fewest bytes; reduce_scatter: "
                  "quantizers only; shared_index and sparse_allreduce: top-k only; low_rank: "
                  "powersgd only).")
flags.DEFINE_float("overlap_mb", 25.0,
                   "Gradient MiB per bucket: each step's gradients are reduced in buckets, last "
                   "layers first, while back-propagation goes on; on the reduce-scatter a "
                   "larger gradient is reduced in pieces of this size (0: one bucket after "
                   "the whole backward pass).", lower_bound=0.0)
flags.DEFINE_integer("steps_per_epoch", 0, "Cap on steps per epoch (0: a full shard).",
                     lower_bound=0)
flags.DEFINE_string("save_weights", "", "If set, each worker saves its final weights to "
                    "PATH.w<index>.npz.")
flags.DEFINE_string("json_out", "", "If set, worker 0 writes its results here as JSON.")
flags.DEFINE_integer("timeout", 0, "With --workers, stop the local cluster after this many "
                     "seconds (0: no limit).", lower_bound=0)
flags.DEFINE_integer("restarts", 0, "With --workers, restart the local cluster up to this many "
                     "times when a worker fails (use with --backup_dir).", lower_bound=0)
flags.DEFINE_string("backup_dir", "", "If set, Keras BackupAndRestore backs up the model, the "
                    "optimizer and every worker's compression state here each epoch, and a "
                    "restarted run resumes from it.")
flags.DEFINE_bool("eval_each_epoch", False, "Evaluate on the test set after every epoch and "
                  "record the curve (test accuracy, cumulative bytes sent, training time) in "
                  "the results.")
flags.DEFINE_bool("tf_logs", False, "Show TensorFlow's own INFO log lines (collective launches, "
                  "cluster set-up); off by default so that a run shows progress and results.")
flags.DEFINE_string("tensorboard", "", "If set, each worker writes its compression statistics "
                    "(bytes, ratios, residual norms, the compressor's own diagnostics) as "
                    "TensorBoard scalars under DIR/worker<index>.")
flags.register_validator(
    "model", lambda v: v.strip().lower() in _builtin("models", "MODEL_NAMES") or _is_entry_point(v),
    message="--model must be 'mlp', 'cnn' or package.module:build_fn")
flags.register_validator(
    "dataset", lambda v: v.strip().lower() in _builtin("data", "DATASET_NAMES")
    or _is_entry_point(v),
    message="--dataset must be 'fashion_mnist', 'mnist5k', 'synthetic' or package.module:load_fn")
flags.register_multi_flags_validator(
    ["lr_scaling", "warmup_epochs", "schedule", "recommended"],
    lambda f: (f["lr_scaling"] != "none" or f["schedule"] != "constant"
               or f["recommended"] or not f["warmup_epochs"]),
    message="--warmup_epochs > 0 needs --lr_scaling=linear (the warm-up ramps from "
            "--learning_rate up to the scaled rate) or --schedule=cosine (it ramps up to "
            "--learning_rate, then decays)")


def worker_info(strategy):
    """(index, count) of this worker in the strategy's cluster."""
    from tensorflow.python.distribute import multi_worker_util
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec()
    if not spec.as_dict():
        return 0, 1
    return (multi_worker_util.id_in_cluster(spec, resolver.task_type, resolver.task_id),
            multi_worker_util.worker_count(spec, resolver.task_type))


def warmup_steps_for(warmup_epochs, steps_per_epoch):
    """Optimizer steps in ``warmup_epochs`` epochs of ``steps_per_epoch`` steps (rounded;
    at least 1 when ``warmup_epochs`` > 0)."""
    if warmup_epochs < 0:
        raise ValueError(f"`warmup_epochs` must be >= 0, got {warmup_epochs!r}")
    if not warmup_epochs:
        return 0
    return max(1, int(round(warmup_epochs * steps_per_epoch)))


def cosine_warmup_steps(warmup_steps, total_steps):
    """The warm-up of a cosine schedule, at most a quarter of the run's ``total_steps``
    (a one-epoch warm-up in a one-epoch run would leave no steps to decay over)."""
    return min(warmup_steps, total_steps // 4)


def make_learning_rate(learning_rate, lr_scaling="none", workers=1, warmup_steps=0,
                       schedule="constant", total_steps=0):
    """What the optimizer is given as its learning rate.

    ``lr_scaling="none"``: ``learning_rate`` itself (``warmup_steps`` must be 0 unless
    the schedule is cosine).
    ``"linear"``: a ``tfgc.keras.LinearScalingWarmup`` that ramps from
    ``learning_rate`` to ``workers * learning_rate`` over ``warmup_steps`` steps and
    stays there (Goyal et al. 2017's linear scaling rule and gradual warm-up).
    ``schedule="cosine"``: after the warm-up (from ``learning_rate`` when scaling
    linearly, else from a tenth of it), the peak rate decays along a half cosine to 0
    at step ``total_steps`` (Keras's ``CosineDecay`` with its warm-up).
    """
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"`schedule` must be 'constant' or 'cosine', got {schedule!r}")
    if lr_scaling not in ("none", "linear"):
        raise ValueError(f"`lr_scaling` must be 'none' or 'linear', got {lr_scaling!r}")
    if schedule == "cosine":
        import tf_keras as keras
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) \
                or total_steps <= warmup_steps:
            raise ValueError("a cosine schedule needs `total_steps` > `warmup_steps` "
                             f"({warmup_steps}), got {total_steps!r}")
        peak = learning_rate * (workers if lr_scaling == "linear" else 1)
        start = learning_rate if lr_scaling == "linear" else learning_rate / 10
        if not warmup_steps:
            return keras.optimizers.schedules.CosineDecay(peak, total_steps)
        return keras.optimizers.schedules.CosineDecay(
            start, total_steps - warmup_steps, warmup_target=peak, warmup_steps=warmup_steps)
    if lr_scaling == "none":
        if warmup_steps:
            raise ValueError("`warmup_steps` must be 0 without learning-rate scaling "
                             f"(lr_scaling='none'), got {warmup_steps!r}")
        return learning_rate
    from tfgc.keras.schedules import LinearScalingWarmup
    return LinearScalingWarmup(learning_rate, workers, warmup_steps)


def make_optimizer(name, learning_rate, compressor=None, *, lr_scaling="none", workers=1,
                   warmup_steps=0, schedule="constant", total_steps=0):
    """The Keras optimizer ``name``; momentum SGD leaves its momentum to a compressor
    that applies it on the workers (DGC's momentum correction).

    ``learning_rate`` may be a number or a Keras ``LearningRateSchedule``; with
    ``lr_scaling="linear"`` it is the one-worker rate, scaled to ``workers`` times it
    after ``warmup_steps`` of linear warm-up; ``schedule="cosine"`` decays it to 0 at
    ``total_steps`` (see ``make_learning_rate``)."""
    import tf_keras as keras
    learning_rate = make_learning_rate(learning_rate, lr_scaling, workers, warmup_steps,
                                       schedule, total_steps)
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate)
    if name == "momentum":
        if compressor is not None and compressor.applied_momentum:
            return keras.optimizers.SGD(learning_rate)
        return keras.optimizers.SGD(learning_rate, momentum=0.9)
    return keras.optimizers.Adam(learning_rate)


def steps_per_epoch_for(num_examples, num_workers, batch_size, cap=0):
    """Steps per epoch when each of ``num_workers`` workers takes ``batch_size`` rows per
    step from its shard of ``num_examples``, at most ``cap`` (0: no cap). Every worker
    runs the same number: one with an extra step would wait forever in its all-reduce."""
    steps = (num_examples // num_workers) // batch_size
    if cap:
        steps = min(steps, cap)
    if steps < 1:
        raise ValueError(f"batch_size {batch_size} is larger than a worker's shard "
                         f"({num_examples // num_workers})")
    return steps


def training_setting(compressor, *, baseline=False, recommended=False, optimizer="momentum",
                     learning_rate=0.05, schedule="constant", warmup_epochs=0.0,
                     epochs=2, given=frozenset()):
    """The compressor string, optimizer, rate, schedule, warm-up and epochs a run trains
    with.

    Without ``recommended`` they are the given ones. With it, the compressor's
    recommended setting (``tfgc.compressors.recommended``; the dense one with
    ``baseline``) fills in the optimizer, the schedule and the warm-up unless named in
    ``given`` (the flags the user set), multiplies ``learning_rate`` (the dense rate) by
    its rate scale, scales ``epochs`` (the dense run's) by its ``epochs_scale`` unless
    ``"epochs"`` is in ``given``, and replaces a bare compressor name by its recommended
    string. That string may still hold the run's steps per epoch as a placeholder
    (``tfgc.compressors.recommended.needs_steps_per_epoch``), which
    ``recommendation.spec(steps)`` fills in.
    """
    out = {"compressor": compressor, "optimizer": optimizer, "learning_rate": learning_rate,
           "schedule": schedule, "warmup_epochs": warmup_epochs, "epochs": epochs,
           "recommendation": None}
    if not recommended:
        return out
    from tfgc.compressors.recommended import recommended as lookup
    from tfgc.compressors.recommended import resolve
    rec = lookup("none" if baseline else compressor)
    out["recommendation"] = rec
    out["learning_rate"] = rec.learning_rate(learning_rate)
    for name in ("optimizer", "schedule", "warmup_epochs"):
        if name not in given:
            out[name] = getattr(rec, name)
    if "epochs" not in given:
        out["epochs"] = rec.epochs(epochs)
    if not baseline:
        out["compressor"] = resolve(compressor)
    return out


def make_step_timer():
    """A Keras callback recording each training batch's wall time (``median_ms()``)."""
    import numpy as np
    import tf_keras as keras

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.durations = []
            self._start = None

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.durations.append(time.perf_counter() - self._start)

        def median_ms(self, skip=5):
            # The first batches include tracing and cluster warm-up.
            kept = self.durations[skip:] if len(self.durations) > skip else self.durations
            return float(np.median(kept) * 1e3) if kept else 0.0

    return StepTimer()


def make_progress(epochs, steps, stream=None, width=24, updates=10):
    """A Keras callback that draws one text progress bar per epoch, a line at each tenth.

    Built for output that goes through a pipe (the local launcher prefixes every line
    with its worker), where Keras's own bar would print a line at every update.
    """
    import tf_keras as keras

    out = stream or sys.stdout

    class Progress(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._epoch = 0
            self._next = 0
            self._start = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch, self._next, self._start = epoch, 1, time.perf_counter()

        def _line(self, done, logs):
            # Loss and accuracy only at the epoch's end: tf-keras's per-batch logs under
            # MultiWorkerMirroredStrategy add up the workers' figures.
            filled = int(round(width * done / steps))
            figures = "".join(f"  {k} {logs[k]:.4g}" for k in ("loss", "accuracy", "val_accuracy")
                              if k in logs and done == steps)
            if "sent_MB" in (logs or {}):
                figures += f"  sent {logs['sent_MB'] * 1e3:,.1f} kB/step"
            elapsed = time.perf_counter() - self._start
            out.write(f"epoch {self._epoch + 1}/{epochs} [{'#' * filled}{'.' * (width - filled)}]"
                      f" {done}/{steps}  {elapsed:.0f}s{figures}\n")
            out.flush()

        def on_train_batch_end(self, batch, logs=None):
            done = batch + 1
            if done < steps and done >= self._next * steps / updates:
                while self._next * steps / updates <= done:
                    self._next += 1
                self._line(done, logs or {})

        def on_epoch_end(self, epoch, logs=None):
            self._line(steps, logs or {})

    return Progress()


def train_and_evaluate(strategy, *, model="mlp", dataset="mnist5k", epochs=1, batch_size=64,
                       learning_rate=0.05, optimizer="momentum", seed=0, steps_per_epoch=0,
                       data=None, verbose=None, callbacks=(), lr_scaling="none",
                       warmup_epochs=0.0, eval_each_epoch=False, progress=None,
                       tensorboard="", compressor_name=None, schedule="constant"):
    """Trains ``model`` on this worker's shard of ``dataset`` under ``strategy``.

    Returns a dict of results (accuracy, bytes, ratio, step time) and the model.
    ``data`` may pass a loaded ``tfgc.apps.data.Dataset`` to skip loading.
    ``lr_scaling="linear"`` trains at (number of workers) x ``learning_rate`` after
    ``warmup_epochs`` epochs of linear warm-up (see ``make_learning_rate``); the results
    then also hold ``base_learning_rate``, ``peak_learning_rate`` and ``warmup_steps``.
    ``model`` and ``dataset`` may name a user's ``package.module:function`` (see
    ``tfgc.apps.entry_points``). ``eval_each_epoch`` adds ``curve``: per epoch, the test
    accuracy, cumulative bytes sent per worker and training time. ``progress`` (default:
    on worker 0 when ``verbose`` is None) draws a text progress bar instead of Keras's.
    ``tensorboard`` is a directory for ``CompressionStatsCallback(log_dir=...)``.
    ``compressor_name`` is how the results name the compressor (default: its shortest
    string form). ``schedule="cosine"`` decays the rate to 0 over the run's
    ``epochs * steps`` steps after the warm-up.
    """
    import tf_keras as keras

    from tfgc.apps import data as data_lib
    from tfgc.apps import models

    rank, num_workers = worker_info(strategy)
    ds = data if data is not None else data_lib.load_dataset(dataset, seed=seed)
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, num_workers)
    # Every worker must run the same number of steps: a worker with one more would
    # wait forever in its all-reduce. Shards differ by at most one example.
    steps = steps_per_epoch_for(len(ds.x_train), num_workers, batch_size, steps_per_epoch)
    # batch_size rows per worker and step: the dataset carries the global batch.
    train_ds = data_lib.make_tf_dataset(x, y, batch_size, seed=seed + rank, repeat=True,
                                        workers=num_workers)
    test_ds = data_lib.make_tf_dataset(ds.x_test, ds.y_test, 500, shuffle=False,
                                       drop_remainder=False)
    warmup_steps = warmup_steps_for(warmup_epochs, steps)
    if schedule == "cosine":
        warmup_steps = cosine_warmup_steps(warmup_steps, epochs * steps)

    from tfgc.apps.entry_points import outputs_probabilities
    with strategy.scope():
        compressor = getattr(strategy, "compressor", None)
        # Variance-based compression reads per-sample second moments: MomentDense.
        net = models.build_model(model, input_shape=ds.x_train.shape[1:],
                                 num_classes=ds.num_classes, seed=seed,
                                 moments=bool(compressor is not None
                                              and compressor.needs_second_moment))
        net.compile(optimizer=make_optimizer(optimizer, learning_rate, compressor,
                                             lr_scaling=lr_scaling, workers=num_workers,
                                             warmup_steps=warmup_steps, schedule=schedule,
                                             total_steps=epochs * steps),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=not outputs_probabilities(net)),
                    metrics=["accuracy"])

    timer = make_step_timer()
    all_callbacks = [timer] + list(callbacks)
    stats_cb = None
    if hasattr(strategy, "compression_stats"):
        from tfgc.keras import CompressionStatsCallback
        stats_cb = CompressionStatsCallback(strategy, log_dir=tensorboard or None)
        all_callbacks.append(stats_cb)
        if getattr(strategy.compressor, "plans_per_tensor", False):
            # compressor="auto": the plan follows the link and the critical regimes.
            from tfgc.keras import AutoPlanCallback
            all_callbacks.append(AutoPlanCallback(strategy))
    elif tensorboard:
        raise ValueError("`tensorboard` writes tfgc's compression statistics; the stock "
                         "strategy has none (leave it out with the baseline)")
    curve_cb = None
    if eval_each_epoch:
        curve_cb = _make_curve_recorder(strategy, net, test_ds, num_workers)
        all_callbacks.insert(1, curve_cb)
    if progress is None:
        progress = verbose is None and rank == 0
    if progress:
        all_callbacks.append(make_progress(epochs, steps))
    if verbose is None:
        verbose = 0
    start = time.perf_counter()
    net.fit(train_ds, epochs=epochs, steps_per_epoch=steps, callbacks=all_callbacks,
            verbose=verbose)
    train_seconds = time.perf_counter() - start
    loss, accuracy = net.evaluate(test_ds, verbose=0)

    if stats_cb is not None:
        stats = strategy.compression_stats()
    else:
        dense = dense_bytes(net)
        ring = stock_ring_bytes(net, num_workers)
        stats = {"dense_bytes": dense, "payload_bytes": dense, "sent_bytes": ring,
                 "received_bytes": ring, "dense_sent_bytes": ring, "ratio": 1.0,
                 "wire_ratio": 1.0 if ring else 0.0}
    compressor = getattr(strategy, "compressor", None)
    results = {
        "compressor": ((compressor_name or _name(compressor)) if compressor is not None
                       else "baseline"),
        "compressor_config": _spec(compressor) if compressor is not None else "baseline",
        "baseline": stats_cb is None,
        "model": model, "dataset": ds.name, "workers": num_workers, "rank": rank,
        "epochs": epochs, "steps_per_epoch": steps, "batch_size": batch_size,
        "test_accuracy": float(accuracy), "test_loss": float(loss),
        "dense_bytes_per_step": int(stats["dense_bytes"]),
        "payload_bytes_per_step": int(stats["payload_bytes"]),
        "sent_bytes_per_step": int(stats["sent_bytes"]),
        "received_bytes_per_step": int(stats["received_bytes"]),
        "dense_sent_bytes_per_step": int(stats["dense_sent_bytes"]),
        "ratio": float(stats["ratio"]), "wire_ratio": float(stats["wire_ratio"]),
        "step_time_ms": timer.median_ms(), "train_seconds": train_seconds,
        "optimizer": optimizer, "learning_rate": float(learning_rate), "schedule": schedule,
        "warmup_steps": warmup_steps,
    }
    if curve_cb is not None:
        results["curve"] = curve_cb.curve
    if lr_scaling != "none":
        from tfgc.keras.schedules import scaled_learning_rate
        results.update({"lr_scaling": lr_scaling,
                        "base_learning_rate": float(learning_rate),
                        "peak_learning_rate": scaled_learning_rate(learning_rate, num_workers),
                        "warmup_steps": warmup_steps})
    return results, net


def dense_bytes(net):
    """Bytes of the model's gradients, dense."""
    return sum(int(v.shape.num_elements()) * v.dtype.size for v in net.trainable_variables)


def stock_ring_bytes(net, num_workers):
    """What the stock ring all-reduce sends per worker and step: 2(N-1)/N of the gradients."""
    return 2 * (num_workers - 1) * dense_bytes(net) // num_workers


def _make_curve_recorder(strategy, net, test_ds, num_workers):
    """A callback that evaluates after each epoch and records the accuracy-bytes-time curve.

    Evaluation time is left out of the training time. Bytes are what this worker sent:
    the compression statistics' totals, or for the stock strategy its ring all-reduce
    (2(N-1)/N of the gradients per step).
    """
    import tf_keras as keras

    class Curve(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.curve = []
            self._train = 0.0
            self._steps = 0
            self._start = None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self._steps += 1

        def on_epoch_end(self, epoch, logs=None):
            self._train += time.perf_counter() - self._start
            _, accuracy = net.evaluate(test_ds, verbose=0)
            if hasattr(strategy, "compression_stats"):
                sent = int(strategy.compression_stats()["total_sent_bytes"])
            else:
                sent = self._steps * stock_ring_bytes(net, num_workers)
            self.curve.append({"epoch": epoch + 1, "test_accuracy": float(accuracy),
                               "cumulative_sent_bytes": sent, "train_seconds": self._train})
            if logs is not None:
                logs["val_accuracy"] = float(accuracy)

    return Curve()


def _name(compressor):
    from tfgc.compressors import describe
    try:
        return describe(compressor)
    except ValueError:
        return repr(compressor)


def _spec(compressor):
    from tfgc.compressors import serialize
    try:
        return serialize(compressor)
    except ValueError:
        return repr(compressor)


def _launch_local_cluster():
    from tfgc.apps.launch import launch
    # absl hands main() only the positional arguments; the workers need every flag.
    command = [sys.executable, "-m", "tfgc.apps.train"] + sys.argv[1:]
    result = launch(command, FLAGS.workers, timeout=FLAGS.timeout or None,
                    restarts=FLAGS.restarts, echo=None if FLAGS.tf_logs else shown_line)
    if not result.ok:
        print(result.message, file=sys.stderr)
    return result.returncode


def _check_entry_points():
    """Finds a user's --model / --dataset module before any worker starts, so that a typo
    stops the run at once with one message instead of once per worker. The module is
    located, not imported (importing it would import TensorFlow here too); the workers
    import it and check the function."""
    from tfgc.apps import entry_points
    for flag in ("model", "dataset"):
        value = getattr(FLAGS, flag).strip()
        if not entry_points.is_entry_point(value):
            continue
        module = value.split(":", 1)[0]
        if not entry_points.module_exists(value):
            sys.exit(f"tfgc-train: --{flag}={value!r}: no module named {module!r} on the Python "
                     f"path (the current directory {os.getcwd()!r} included)")


def shown_line(line):
    """False for a line of TensorFlow's start-up noise (``tfgc.apps.launch.is_tensorflow_noise``)."""
    from tfgc.apps.launch import is_tensorflow_noise
    return not is_tensorflow_noise(line)


def _quiet_tensorflow():
    """TensorFlow's INFO lines (cluster set-up, one per collective launch) hide the run's
    progress; --tf_logs shows them."""
    if FLAGS.tf_logs:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from absl import logging as absl_logging
    if absl_logging.get_verbosity() <= absl_logging.INFO:
        absl_logging.set_verbosity(absl_logging.WARNING)


def main(argv):
    _quiet_tensorflow()
    _check_entry_points()
    launching = FLAGS.workers > 1 and not os.environ.get("TF_CONFIG")
    _check_recommended_flag()
    _check_compression_flags(launching)
    if launching:
        if FLAGS.tensorboard and FLAGS.baseline:
            sys.exit("tfgc-train: --tensorboard writes tfgc's compression statistics; the "
                     "stock strategy (--baseline) has none")
        sys.exit(_launch_local_cluster())

    import numpy as np
    import tensorflow as tf
    import tf_keras

    import tfgc

    tf.get_logger().setLevel("INFO" if FLAGS.tf_logs else "WARNING")

    setting = training_setting(
        FLAGS.compressor, baseline=FLAGS.baseline, recommended=FLAGS.recommended,
        optimizer=FLAGS.optimizer, learning_rate=FLAGS.learning_rate,
        schedule=FLAGS.schedule, warmup_epochs=FLAGS.warmup_epochs, epochs=FLAGS.epochs,
        given={name for name in ("optimizer", "schedule", "warmup_epochs", "epochs")
               if FLAGS[name].present})
    from tfgc.compressors.recommended import needs_steps_per_epoch
    needs_steps = not FLAGS.baseline and needs_steps_per_epoch(setting["compressor"])
    if FLAGS.baseline:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        # A recommended string that needs the steps per epoch (dgc's warm-up) is set once
        # they are known; the bare name builds the strategy meanwhile.
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
            compressor=FLAGS.compressor if needs_steps else setting["compressor"],
            policy=tfgc.CompressionPolicy(min_elements=FLAGS.min_elements),
            communication=FLAGS.communication,
            overlap_bytes=int(round(FLAGS.overlap_mb * (1 << 20))))
    data = None
    if needs_steps:
        from tfgc.apps import data as data_lib
        data = data_lib.load_dataset(FLAGS.dataset, seed=FLAGS.seed)
        _, num_workers = worker_info(strategy)
        steps = steps_per_epoch_for(len(data.x_train), num_workers, FLAGS.batch_size,
                                    FLAGS.steps_per_epoch)
        setting["compressor"] = setting["recommendation"].spec(steps)
        strategy.compressor = setting["compressor"]
    tf_keras.utils.set_random_seed(FLAGS.seed)
    callbacks = []
    if FLAGS.backup_dir:
        callbacks.append(tf_keras.callbacks.BackupAndRestore(FLAGS.backup_dir))
    results, net = train_and_evaluate(
        strategy, model=FLAGS.model, dataset=FLAGS.dataset, epochs=setting["epochs"],
        batch_size=FLAGS.batch_size, learning_rate=setting["learning_rate"],
        optimizer=setting["optimizer"], seed=FLAGS.seed, steps_per_epoch=FLAGS.steps_per_epoch,
        data=data, callbacks=callbacks, lr_scaling=FLAGS.lr_scaling,
        warmup_epochs=setting["warmup_epochs"], schedule=setting["schedule"],
        eval_each_epoch=FLAGS.eval_each_epoch, tensorboard=FLAGS.tensorboard,
        compressor_name=None if FLAGS.baseline else setting["compressor"])
    if setting["recommendation"] is not None:
        results["recommended"] = setting["recommendation"].describe(
            compressor=None if FLAGS.baseline else setting["compressor"])

    if FLAGS.save_weights:
        np.savez(f"{FLAGS.save_weights}.w{results['rank']}.npz",
                 *[w.numpy() for w in net.weights])
    if results["rank"] == 0:
        print(f"compressor     {results['compressor']}")
        print(f"test accuracy  {results['test_accuracy']:.4f}")
        print(f"payload/step   {results['payload_bytes_per_step']:,} bytes of "
              f"{results['dense_bytes_per_step']:,} dense (ratio {results['ratio']:.1f}x)")
        print(f"wire/step      {results['sent_bytes_per_step']:,} bytes sent per worker; a dense "
              f"ring all-reduce sends {results['dense_sent_bytes_per_step']:,}")
        print(f"step time      {results['step_time_ms']:.2f} ms (median)")
        if "recommended" in results:
            print(f"setting        recommended: {results['recommended']}")
        if "peak_learning_rate" in results:
            print(f"learning rate  {results['peak_learning_rate']:g} peak "
                  f"({results['base_learning_rate']:g} x {results['workers']} workers, "
                  f"{results['lr_scaling']} scaling; warm-up {results['warmup_steps']} steps)")
        print("RESULT " + json.dumps(results, sort_keys=True))
        if FLAGS.json_out:
            with open(FLAGS.json_out, "w") as f:
                json.dump(results, f, indent=2, sort_keys=True)


_HELP_ARGS = ("-h", "--help", "-help", "--helpshort", "-?")


def _print_help():
    """--help: what the trainer does and its own flags (absl's default lists none when the
    trainer runs as the tfgc-train console script, and exits 1)."""
    print(__doc__.strip().replace("``", "'"))
    print("\nflags (--helpfull adds absl's and TensorFlow's own):\n")
    print(FLAGS.module_help(__name__).strip("\n"))


def compression_error(compressor, communication):
    """What is wrong with --compressor/--communication, as one line; None when nothing."""
    from tfgc.distribute.cross_device_ops import check_compression_args
    try:
        check_compression_args(compressor, None, communication, 1)
    except ValueError as exc:
        return (f"tfgc-train: --compressor={compressor!r}"
                f"{'' if communication == 'auto' else f' --communication={communication}'}"
                f": {exc}")
    return None


def _check_recommended_flag():
    """--recommended needs a compressor with a recommended setting. Every registry name
    has one (tests/test_recommended.py checks), so what fails here is a name the
    registry does not know either: one line with the nearest recommended name, before
    TensorFlow is imported or any worker starts, instead of a traceback from each."""
    if not FLAGS.recommended or FLAGS.baseline:
        return
    from tfgc.compressors.recommended import recommended as lookup
    try:
        lookup(FLAGS.compressor)
    except ValueError as exc:
        sys.exit(f"tfgc-train: --recommended: {exc}; drop --recommended and set "
                 "--optimizer and --learning_rate yourself")


def _check_compression_flags(launching):
    """Builds the compressor from --compressor (and checks --communication against it)
    before training: a typo stops the run with one line naming the flag, instead of a
    traceback from every worker.

    A process that launches a local cluster asks a child process: importing TensorFlow
    here would hold it, and its memory, for the whole run, and its native start-up lines
    are filtered from the child's output like the workers'. Otherwise (one worker, or a
    worker of a TF_CONFIG cluster) TensorFlow is imported anyway.
    """
    if FLAGS.baseline:
        return
    if not launching:
        error = compression_error(FLAGS.compressor, FLAGS.communication)
        if error:
            sys.exit(error)
        return
    import subprocess
    code = ("import sys; from tfgc.apps.train import compression_error; "
            "e = compression_error(sys.argv[1], sys.argv[2]); print(e or ''); "
            "sys.exit(1 if e else 0)")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    proc = subprocess.run([sys.executable, "-c", code, FLAGS.compressor, FLAGS.communication],
                          capture_output=True, text=True, env=env)
    if proc.returncode == 0:
        return
    if proc.stdout.strip():
        sys.exit(proc.stdout.strip().splitlines()[-1])
    # The check itself failed (TensorFlow would not import, say): show why.
    shown = [line for line in proc.stderr.splitlines(keepends=True)
             if FLAGS.tf_logs or shown_line(line)]
    sys.exit("tfgc-train: checking --compressor failed (exit status "
             f"{proc.returncode}):\n" + "".join(shown[-20:]).rstrip())


def run():
    if any(arg in _HELP_ARGS for arg in sys.argv[1:]):
        _print_help()
        sys.exit(0)
    app.run(main)


if __name__ == "__main__":
    run()
