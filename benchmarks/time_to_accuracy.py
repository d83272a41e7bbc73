"""Time to accuracy: how soon each setting reaches dense accuracy on a shaped link (root).

    sudo python benchmarks/time_to_accuracy.py                  # the default sweep
    sudo python benchmarks/time_to_accuracy.py --models cnn --rates 100mbit \\
        --settings stock bf16 dgc --budget 300
    sudo python benchmarks/time_to_accuracy.py --resume         # go on with a cut sweep

A cluster of ``--workers`` workers (default 4) on this one machine, each in its own
network namespace behind a tbf-shaped link (``netns.py``, as ``network.py``), trains a
Fashion-MNIST model with ``model.fit`` until the test accuracy reaches the target or
the run's time budget is spent. Models: ``cnn`` and ``mlp`` (``tfgc.apps.models``),
``wide_mlp`` (network.py's), Keras's ``mobilenetv2`` (``build_mobilenetv2``), and
``encoder``, benchmarks/models.py's Transformer encoder (two layers of width 128) over
the images read as sentences of 49 words, a 4 x 4 patch a word (``patch_tokens``),
whose token embedding of 65,536 x 128 (8.4 of its 8.8 M parameters) has an
IndexedSlices gradient of the rows a batch touched. Worker 0 evaluates the whole test set every
``--eval_every`` seconds of training on a copy of its weights outside the strategy (no
collective, so the other workers need not agree on when); evaluation time is left out
of the training time. The clock starts after the first step (tracing) and includes
everything else a user waits for: compute, compression, the wire. When worker 0 sees the
target reached, or the budget spent, it names a step two steps ahead in a file the
other workers read after every step, and all stop after that step together.

Settings: ``stock`` (``tf.distribute.MultiWorkerMirroredStrategy``, fp32), ``bf16``
(tfgc's 16-bit cast, the honest baseline of Han et al. 2024) and registry compressors,
each at its recommended setting (``tfgc.compressors.recommended``: compressor string,
optimizer, learning-rate scale, a one-epoch warm-up (at most a quarter of the run)
and a cosine decay over
``--epochs`` times the setting's epochs scale (2 where error feedback or a biased
code needs more, cheaper steps to reach dense accuracy; 1 for the casts and 8-bit
QSGD and ``auto``), or ``--compressed_epochs`` for every setting of scale 2). The
dense rate is ``--learning_rate`` at ``--batch_size`` rows per worker.

Target: per model, the stock strategy first trains its whole schedule on a
``--floor_rate`` link (default 10gbit, where the link is not what limits it: the
compute floor); its final accuracy minus ``--margin`` points (default 0.5) is the
target for every run of that model (or ``--target`` gives it). The floor run's
time to the target is the machine's compute floor.

Synchronous training computes the same steps at any link rate (the same seed gives
the same weights, data order and random draws), so a setting that reaches the
target at step S on one link reaches it at step S on every link. When a run spends
its budget first, the table gives its best accuracy and, where the same setting
reached the target on another link, a projection: S times this run's median step
time (marked "projected").

Outputs (``--out PREFIX``, default ``benchmarks/results/time_to_accuracy``):
PREFIX.md, PREFIX.json (every run, its accuracy curve; ``--resume`` reads it) and
PREFIX_<model>_<rate>.svg (test accuracy against training time). Without root,
``ip``/``tc`` or namespaces it prints why and exits 0. Namespaces are removed on every
exit path, as in ``network.py``.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
import network  # noqa: E402  (worker environment, supervision, signals, the wide MLP)
from netns import Cluster, NetError  # noqa: E402
from network_report import rate_bps, rate_label  # noqa: E402
from tfgc.apps.plots import fmt_bytes, svg_plot  # noqa: E402  (stdlib only)

DEFAULT_OUT = os.path.join(_common.RESULTS_DIR, "time_to_accuracy")
BASE_PORT = 21000
MODELS = ("cnn", "wide_mlp", "mlp", "mobilenetv2", "encoder")
STOCK = "stock"
DEFAULT_SETTINGS = [STOCK, "bf16", "qsgd", "terngrad", "onebit", "ef", "dgc", "powersgd"]
DEFAULT_EPOCHS = {"cnn": 3, "wide_mlp": 3, "mlp": 3, "mobilenetv2": 3, "encoder": 3}
# ``encoder`` reads each image as a sentence (``patch_tokens``): its PATCH x PATCH
# patches, row by row, are the words, a word's id the patch's pixels above
# PATCH_THRESHOLD as bits, so the vocabulary has 2^(PATCH^2) words.
PATCH, PATCH_THRESHOLD = 4, 0.3
# Test rows a worker-0 evaluation puts through the model at once.
EVAL_CHUNK = 1000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=["cnn", "wide_mlp"])
    p.add_argument("--rates", nargs="*", default=["1gbit", "100mbit"],
                   help="link rates in tc's syntax, run fastest first (default 1gbit "
                        "100mbit; none: the floor runs alone, each setting's steps to the "
                        "target)")
    p.add_argument("--floor_rate", default="10gbit",
                   help="the link of the floor runs; stock's sets the target (default 10gbit)")
    p.add_argument("--floor", nargs="+", default=["all"], metavar="SETTING",
                   help="the settings that also train on the floor link, without a budget "
                        "('all', the default, or some of --settings; stock always does): "
                        "their time to target there is their compute floor, and their step "
                        "count there projects their runs that spend their budget")
    p.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS,
                   help="'stock', registry names at their recommended setting, or "
                        "compressor strings (trained with their compressor's recommended "
                        "optimizer and schedule); auto's may end in ~ and AutoPlanCallback's "
                        "options ('auto~noise=0') "
                        f"(default: {' '.join(DEFAULT_SETTINGS)})")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=0,
                   help="epochs of the schedule (0: per model, "
                        f"{', '.join(f'{k} {v}' for k, v in DEFAULT_EPOCHS.items())})")
    p.add_argument("--compressed_epochs", type=int, default=0,
                   help="epochs of the schedule of every setting whose recommendation "
                        "trains longer than dense (not stock, bf16, 8-bit QSGD or auto) "
                        "(0: --epochs times the setting's recommended epochs scale)")
    p.add_argument("--batch_size", type=int, default=64, help="rows per worker and step")
    p.add_argument("--learning_rate", type=float, default=0.05,
                   help="the dense rate (momentum SGD); settings scale it")
    p.add_argument("--margin", type=float, default=0.5,
                   help="points below the floor run's final accuracy (default 0.5)")
    p.add_argument("--target", type=float, default=None,
                   help="target test accuracy for every model (default: from the floor run)")
    p.add_argument("--budget", type=float, default=600.0,
                   help="seconds of training per run before it stops unreached (default 600)")
    p.add_argument("--eval_every", type=float, default=10.0,
                   help="seconds of training between evaluations (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--auto_every_steps", type=int, default=0,
                   help="compressor='auto': AutoPlanCallback's interval in steps (default 0: "
                        "one epoch, as tfgc-train)")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds per run before its workers are killed (0: budget x 3 + 300)")
    p.add_argument("--resume", action="store_true", help="keep the runs already in PREFIX.json")
    p.add_argument("--out", default=DEFAULT_OUT)
    # Worker-only arguments.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--run_epochs", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run_target", type=float, default=-1.0, help=argparse.SUPPRESS)
    p.add_argument("--result_prefix", help=argparse.SUPPRESS)
    p.add_argument("--stop_file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.workers < 2 or args.workers > 200:
        p.error("--workers must be in [2, 200] (a link to shape; addresses in a /24)")
    for name in ("budget", "eval_every", "learning_rate"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be > 0")
    if args.batch_size < 1 or args.epochs < 0 or args.compressed_epochs < 0:
        p.error("--batch_size must be >= 1, --epochs and --compressed_epochs >= 0")
    if args.target is not None and not 0 < args.target <= 1:
        p.error("--target is an accuracy in (0, 1]")
    for rate in args.rates + [args.floor_rate]:
        try:
            rate_bps(rate)
        except ValueError as exc:
            p.error(str(exc))
    args.rates = sorted(dict.fromkeys(args.rates), key=rate_bps, reverse=True)
    args.settings = list(dict.fromkeys(args.settings))
    if STOCK not in args.settings:
        args.settings.insert(0, STOCK)
    unknown = [s for s in args.floor if s != "all" and s not in args.settings]
    if unknown:
        p.error(f"--floor names settings not in --settings: {', '.join(unknown)}")
    for setting in args.settings:
        try:
            base, options = split_setting(setting)
        except ValueError as exc:
            p.error(str(exc))
        if options and not _is_auto(base):
            p.error(f"{setting}: options after ~ are AutoPlanCallback's, for auto only")
    bad = [s for s in args.settings if s != STOCK and not _known(s)]
    if bad:
        p.error(f"no recommended setting for {', '.join(bad)} (see tfgc.compressors."
                "recommended)")
    return args


def build_mobilenetv2(keras, input_shape, num_classes, seed=0):
    """Keras's MobileNetV2 as a user would take it (``weights=None``, its own head,
    logits out: 2.27 M parameters, 158 gradients), on the images padded from
    28 to 32 pixels a side, the least it accepts. Seeded through Keras's global seed:
    its layers take no initializer of ours."""
    keras.utils.set_random_seed(seed)
    image = keras.Input(shape=tuple(input_shape), name="image")
    padded = keras.layers.ZeroPadding2D(2, name="pad_to_32")(image)
    net = keras.applications.MobileNetV2(weights=None, input_tensor=padded,
                                         classes=num_classes, classifier_activation=None)
    # Its batch normalizations average their statistics at momentum 0.999, made for
    # ImageNet's hundreds of thousands of steps: after 300 steps here the averages
    # were still so far off that the test accuracy was 9 % (73 % with the batch's own
    # statistics). Keras's default, 0.99, settles within a few hundred steps.
    for layer in net.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = 0.99
    return net


def patch_tokens(images, patch=PATCH, threshold=PATCH_THRESHOLD):
    """Images ``[n, h, w, 1]`` in [0, 1] as sentences ``[n, (h/patch) (w/patch)]`` of
    int32 word ids, the patches row by row: pixel (i, j) of a patch, when above
    ``threshold``, is bit ``i * patch + j`` of its word. Fashion-MNIST's training
    images use about 30,600 of the 65,536 words of 4 x 4 patches, and a batch of 32
    images about 300 distinct ones (its 1,568 words are mostly blank or solid
    patches), so the Transformer's token embedding is a large table whose gradient is
    an IndexedSlices of few rows, as a language model's is."""
    import numpy as np

    n, h, w = images.shape[:3]
    if h % patch or w % patch:
        raise ValueError(f"images of {h} x {w} pixels do not split into {patch} x {patch} "
                         "patches")
    bits = (images.reshape(n, h, w) > threshold).astype(np.uint8)
    bits = bits.reshape(n, h // patch, patch, w // patch, patch).transpose(0, 1, 3, 2, 4)
    bits = bits.reshape(n, (h // patch) * (w // patch), patch * patch)
    return np.tensordot(bits, np.left_shift(1, np.arange(patch * patch), dtype=np.int32),
                        axes=1).astype(np.int32)


def _recommendations():
    """``tfgc/compressors/recommended.py`` loaded by path: the ``tfgc.compressors``
    package imports TensorFlow, which the driver never does."""
    import importlib.util
    path = os.path.join(_common.REPO_ROOT, "tfgc", "compressors", "recommended.py")
    spec = importlib.util.spec_from_file_location("_tfgc_recommended", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What an ``auto`` setting may give ``AutoPlanCallback`` after "~" ("auto~noise=0"), with
# its type ("@" names a reduction path in ``network.py``'s configurations).
CALLBACK_OPTIONS = {"noise": float}


def split_setting(setting):
    """A setting's compressor part and the ``AutoPlanCallback`` options after its "~"
    ("auto~noise=0": "auto", {"noise": 0.0}); ValueError for an unknown option."""
    name, _, rest = setting.partition("~")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in CALLBACK_OPTIONS:
            raise ValueError(f"unknown callback option {key!r} in {setting!r} "
                             f"(known: {', '.join(CALLBACK_OPTIONS)})")
        options[key] = CALLBACK_OPTIONS[key](value)
    return name, options


def _is_auto(setting):
    """Whether ``setting`` trains under ``compressor="auto"`` (its options aside)."""
    return split_setting(setting)[0].split(":")[0] == "auto"


def _known(name):
    try:
        _recommendations().recommended(split_setting(name)[0])
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------
# Worker: one cluster member inside its namespace.

def worker_main(args):
    network.run_worker(args.result_prefix,
                       lambda rank, prefix, phase: _worker(args, rank, prefix, phase))


def _worker(args, rank, prefix, phase):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    import tfgc
    from tfgc.apps import data as data_lib
    from tfgc.apps import models
    from tfgc.apps.train import (cosine_warmup_steps, dense_bytes, make_optimizer,
                                 steps_per_epoch_for, stock_ring_bytes, warmup_steps_for,
                                 worker_info)
    from tfgc.compressors.recommended import recommended, resolve

    # The driver starts this many workers and names them in TF_CONFIG (checked below).
    num_workers = int(os.environ["TFGC_NUM_WORKERS"])
    threads = max(1, (os.cpu_count() or 1) // num_workers)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)

    phase[0] = "data"
    ds = data_lib.load_dataset("fashion_mnist", seed=args.seed)
    steps = steps_per_epoch_for(len(ds.x_train), num_workers, args.batch_size)
    setting, callback_options = split_setting(args.setting)
    rec = recommended("none" if setting == STOCK else setting)
    spec = None if setting == STOCK else resolve(setting, steps)
    phase[0] = "strategy"
    if spec is None:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor=spec)
    named = worker_info(strategy)[1]
    if named != num_workers:
        raise RuntimeError(f"TF_CONFIG names {named} workers, the driver started {num_workers}")
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, num_workers)
    x_test = ds.x_test
    if args.model == "encoder":  # this worker's shard, and the test set on worker 0
        x, x_test = patch_tokens(x), (patch_tokens(x_test) if rank == 0 else None)
    train_ds = data_lib.make_tf_dataset(x, y, args.batch_size, seed=args.seed + rank,
                                        repeat=True, workers=num_workers)

    phase[0] = "model"

    def build():
        if args.model == "wide_mlp":
            return network.build_wide_mlp(keras, ds.x_train.shape[1:], ds.num_classes,
                                          seed=args.seed)
        if args.model == "mobilenetv2":
            return build_mobilenetv2(keras, ds.x_train.shape[1:], ds.num_classes,
                                     seed=args.seed)
        if args.model == "encoder":
            import models as user_models  # benchmarks/models.py

            return user_models.build_encoder(keras, vocab=1 << PATCH ** 2,
                                             seq_len=x.shape[1], num_classes=ds.num_classes)
        return models.build_model(args.model, input_shape=ds.x_train.shape[1:],
                                  num_classes=ds.num_classes, seed=args.seed)

    keras.utils.set_random_seed(args.seed)
    total = args.run_epochs * steps
    compressor = getattr(strategy, "compressor", None)
    with strategy.scope():
        net = build()
        net.compile(optimizer=make_optimizer(
            rec.optimizer, rec.learning_rate(args.learning_rate), compressor,
            warmup_steps=cosine_warmup_steps(warmup_steps_for(rec.warmup_epochs, steps), total),
            schedule=rec.schedule,
            total_steps=total),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    # Worker 0's evaluation copy, outside the strategy: no collective, no agreement.
    # (Only worker 0 evaluates.)
    if rank == 0:
        copy = build()
        test_chunks = [(tf.constant(x_test[k:k + EVAL_CHUNK]),
                        tf.constant(ds.y_test[k:k + EVAL_CHUNK].astype(np.int64)))
                       for k in range(0, len(x_test), EVAL_CHUNK)]

        @tf.function
        def correct_in(xs, ys):  # one graph for every chunk of the same size
            return tf.reduce_sum(tf.cast(tf.argmax(copy(xs, training=False), 1) == ys,
                                         tf.int32))

        def correct():
            return sum(int(correct_in(xs, ys)) for xs, ys in test_chunks)

        def evaluate():
            # This worker's own values: reading a batch normalization's moving
            # statistics (sync-on-read variables) through the strategy would all-reduce
            # them, a collective the other workers never join.
            copy.set_weights([strategy.experimental_local_results(w)[0].numpy()
                              for w in net.weights])
            return float(correct()) / len(ds.y_test)

    target = args.run_target if args.run_target > 0 else None

    class Clock(keras.callbacks.Callback):
        """Steps, training time, evaluations, and the agreed stop."""

        def __init__(self):
            super().__init__()
            self.step = 0
            self.durations = []
            self.curve = []
            self.eval_s = 0.0
            self.t0 = None
            self.first_step_s = None
            self.reached = None
            self.stop_at = None
            self.stop_reason = None
            self.last_train_s = 0.0
            self._t = None
            self._due = None
            self._next_eval = args.eval_every

        def train_s(self, now):
            return now - self.t0 - self.eval_s

        def on_train_batch_begin(self, batch, logs=None):
            # Worker 0 evaluates the last step's weights here rather than at its end:
            # a callback after this one (AutoPlanCallback) then times its steps without
            # the evaluations, and its work after a step still counts as training.
            if self._due is not None:
                self._evaluate(self._due)
                self._due = None
                why = ("target" if self.reached is not None
                       else "budget" if self.last_train_s >= args.budget else None)
                if why and self.step < total:
                    # Two steps ahead: a peer cannot finish step + 1 before this worker
                    # sends its gradients for it, so every peer still reads this in time.
                    self.stop_at, self.stop_reason = self.step + 2, why
                    with open(args.stop_file + ".tmp", "w") as f:
                        f.write(f"{self.stop_at} {why}")
                    os.replace(args.stop_file + ".tmp", args.stop_file)
            self._t = time.perf_counter()

        def _evaluate(self, train_s):
            begin = time.perf_counter()
            accuracy = evaluate()
            self.eval_s += time.perf_counter() - begin
            point = {"train_s": train_s, "step": self.step, "test_accuracy": accuracy}
            if compressor is not None:
                point["sent_bytes"] = int(strategy.compression_stats()["total_sent_bytes"])
            self.curve.append(point)
            if target is not None and self.reached is None and accuracy >= target:
                self.reached = point

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            self.step += 1
            self.durations.append(now - self._t)
            if self.step == 1:
                self.t0 = now  # the clock starts after the first (traced) step
                self.first_step_s = now - self._t
                return
            # Training time up to the end of this step; evaluations are left out.
            train_s = self.last_train_s = self.train_s(now)
            if rank == 0 and self.stop_at is None:
                if (train_s >= self._next_eval or self.step == total
                        or train_s >= args.budget):
                    self._due = train_s  # evaluated when the next step begins
                    while self._next_eval <= train_s:
                        self._next_eval += args.eval_every
            if self.stop_at is None and rank != 0 and os.path.exists(args.stop_file):
                with open(args.stop_file) as f:
                    self.stop_at = int(f.read().split()[0])
            if self.stop_at is not None and self.step >= self.stop_at:
                self.model.stop_training = True

    clock = Clock()
    phase[0] = "train"
    t_fit = time.perf_counter()
    callbacks = [clock]
    auto = None
    if getattr(compressor, "plans_per_tensor", False):
        # compressor="auto": the plan follows the link and the critical regimes.
        auto = tfgc.keras.AutoPlanCallback(strategy, every_steps=args.auto_every_steps or None,
                                           **callback_options)

        class PlanLog(keras.callbacks.Callback):
            """Each plan that a step ended with, when it differs from the last: the step,
            the labels (and the tables sent as rows), the gradients in a critical
            regime, the low-rank budget's share in use, the weighing, and the low-rank
            errors the planner had measured (each rank's and top-k's, by gradient: what
            the critical regime's error limit and the budget saw)."""

            def __init__(self):
                super().__init__()
                self.changes, self._key = [], None

            def on_train_batch_end(self, batch, logs=None):
                plan = strategy.compression_plan()
                if plan is None or plan.key() == self._key:
                    return
                self._key = plan.key()
                record = strategy.cross_device_ops._auto.snapshot()  # pylint: disable=protected-access
                change = {"after_step": clock.step,
                          "labels": {e.name: e.label for e in plan.entries},
                          # Tables sent as rows, and what their rows go as.
                          "tables": {t.name: t.label for t in plan.rows_tables},
                          "critical": sorted(e.name for e in plan.entries if e.critical),
                          "errors": {name: {k: round(v, 4) for k, v in rel.items()}
                                     for name, (_, rel) in record.get("low_rank", {}).items()},
                          "low_rank_share": plan.low_rank_share,
                          "predicted_ms": plan.step_seconds() * 1e3}
                if plan.pace is not None:
                    change.update(compute_ms=plan.pace.compute_s * 1e3,
                                  scale=plan.pace.scale,
                                  paced_ms=plan.paced_seconds() * 1e3)
                self.changes.append(change)

        plans = PlanLog()
        callbacks += [auto, plans]
    net.fit(train_ds, epochs=args.run_epochs, steps_per_epoch=steps, callbacks=callbacks,
            verbose=0)
    fit_s = time.perf_counter() - t_fit
    if rank != 0:
        with open(prefix + ".json", "w") as f:
            json.dump({"rank": rank, "steps": clock.step}, f)
        return
    # The clock stops at the end of the last step (fit's own wind-down is not training).
    if not clock.curve or clock.curve[-1]["step"] != clock.step:
        clock._evaluate(clock.last_train_s)
    timed = [d * 1e3 for d in clock.durations[5:]] or [d * 1e3 for d in clock.durations]
    median_ms = statistics.median(timed)
    ring = stock_ring_bytes(net, num_workers)
    if args.model == "encoder":
        # The table's gradient is one row per token of the worker's batch, with its
        # int32 index; the stock strategy all-gathers them (N - 1 times a worker's
        # rows) and all-reduces the rest.
        table = net.get_layer("token_embedding").embeddings
        tokens = args.batch_size * x.shape[1]
        ring += ((num_workers - 1) * tokens * (table.shape[1] * table.dtype.size + 4)
                 - 2 * (num_workers - 1) * table.shape.num_elements() * table.dtype.size
                 // num_workers)
    if compressor is not None:
        stats = strategy.compression_stats()
        sent = stats["total_sent_bytes"] / max(1, stats["steps"])
        described = tfgc.compressors.describe(compressor)
    else:
        sent, described = ring, "stock MultiWorkerMirroredStrategy, fp32"
    accs = [p["test_accuracy"] for p in clock.curve]
    result = {
        "rank": 0, "workers": num_workers, "model": args.model, "setting": args.setting,
        "spec": described, "compressor": spec or "none",
        "recommended": rec.describe(compressor=spec or "none"),
        "optimizer": rec.optimizer, "learning_rate": rec.learning_rate(args.learning_rate),
        "steps_per_epoch": steps, "planned_steps": total, "steps": clock.step,
        "target": target, "reached": clock.reached is not None,
        "time_to_target_s": clock.reached["train_s"] if clock.reached else None,
        "steps_to_target": clock.reached["step"] if clock.reached else None,
        "stop_reason": clock.stop_reason or "schedule end",
        "final_accuracy": accs[-1], "best_accuracy": max(accs),
        "train_s": clock.last_train_s, "eval_s": clock.eval_s, "evaluations": len(accs),
        "first_step_s": clock.first_step_s, "fit_s": fit_s,
        "median_step_ms": median_ms,
        "sent_bytes_per_step": sent, "dense_ring_bytes_per_step": ring,
        "dense_bytes": dense_bytes(net), "curve": clock.curve,
        # Steps (1-based) that took over three median steps, with their milliseconds:
        # retraces, stalls (the training time includes them).
        "slow_steps": [[k + 1, round(d * 1e3, 1)] for k, d in enumerate(clock.durations)
                       if k and d * 1e3 > 3 * median_ms],
    }
    if auto is not None:
        # What auto's own measurements and plan changes cost, inside the training time
        # (``change_s``: the last change's retrace, or the first step's trace where no
        # change was timed).
        plan = strategy.compression_plan()
        result["auto"] = {"measure_s": auto.measure_s, "change_s": auto.change_s,
                          "intervals": auto.costs, "plans": plans.changes}
        if plan is not None:
            # The last plan against its own steps (the last 100, or as many as it ran).
            result["auto"]["plan"] = {
                "labels": {**{e.name: e.label for e in plan.entries},
                           **{t.name: f"rows:{t.label}" for t in plan.rows_tables}},
                "sent_bytes": sum(e.sent_bytes for e in plan.entries)
                + sum(t.sent_bytes for t in plan.rows_tables),
                "predicted_ms": {k: v * 1e3 for k, v in plan.predicted().items()},
                "last_steps_median_ms": statistics.median(timed[-100:])}
    with open(prefix + ".json", "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------
# Driver.

def run_once(cluster, run, args, run_dir, port):
    """Starts one cluster for ``run``; returns worker 0's result or raises RunFailed."""
    prefix = os.path.join(run_dir, "result")
    stop_file = os.path.join(run_dir, "stop")
    if os.path.exists(stop_file):
        os.remove(stop_file)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", run["model"],
           "--setting", run["setting"], "--run_epochs", str(run["epochs"]),
           "--run_target", str(run["target"] if run["target"] is not None else -1),
           "--result_prefix", prefix, "--stop_file", stop_file,
           "--batch_size", str(args.batch_size), "--learning_rate", str(args.learning_rate),
           "--seed", str(args.seed), "--eval_every", str(args.eval_every),
           "--budget", str(run["budget"]), "--auto_every_steps", str(args.auto_every_steps)]
    network.supervise(cluster, cmd, run_dir, port, args.timeout or run["budget"] * 3 + 300,
                      "--timeout")
    with open(f"{prefix}.w0.json") as f:
        return json.load(f)


def _key(run):
    return f"{run['model']}|{run['rate']}|{run['setting']}"


def plan(args, done):
    """The runs, in order: per model the floor runs (stock first: it sets the target),
    then every rate's settings."""
    runs = []
    for model in args.models:
        epochs = args.epochs or DEFAULT_EPOCHS[model]

        def epochs_of(setting):
            if setting == STOCK:
                return epochs
            rec = _recommendations().recommended(split_setting(setting)[0])
            if rec.epochs_scale == 1:  # the dense schedule: bf16, 8-bit QSGD, auto
                return epochs
            return args.compressed_epochs or rec.epochs(epochs)

        for setting in [s for s in args.settings
                        if "all" in args.floor or s in args.floor or s == STOCK]:
            runs.append(dict(model=model, rate=args.floor_rate, setting=setting,
                             epochs=epochs_of(setting),
                             role="floor" if setting == STOCK else "floor_run",
                             budget=1e9))
        for rate in args.rates:
            for setting in args.settings:
                runs.append(dict(model=model, rate=rate, setting=setting,
                                 epochs=epochs_of(setting),
                                 role="run", budget=args.budget))
    for run in runs:
        old = done.get(_key(run))
        if old and old.get("status") == "ok" and old.get("epochs") == run["epochs"]:
            run.update(old)
    return runs


def target_for(args, runs, model):
    if args.target is not None:
        return args.target
    floor = next(r for r in runs if r["model"] == model and r["role"] == "floor")
    if floor.get("status") != "ok":
        return None
    return floor["final_accuracy"] - args.margin / 100


def add_projections(runs):
    """Speed-ups against stock and bf16 on the same link; projections for runs that
    spent their budget where the same setting reached the target on another link."""
    for run in runs:
        if run.get("status") != "ok" or run["role"] != "run":
            continue
        run.pop("projected_s", None)
        # compressor="auto" changes its plan, and so its step time, during a run (the
        # critical intervals in bf16 first): one median step time cannot project it.
        if not run["reached"] and not _is_auto(run["setting"]):
            other = [r for r in runs if r.get("status") == "ok" and r is not run
                     and r["model"] == run["model"] and r["setting"] == run["setting"]
                     and r.get("reached") and r["role"] != "floor"]
            if run["setting"] == STOCK:
                other += [r for r in runs if r.get("status") == "ok"
                          and r["model"] == run["model"] and r["role"] == "floor"
                          and r.get("steps_to_target")]
            if other:
                run["projected_s"] = (other[0]["steps_to_target"] * run["median_step_ms"] / 1e3)
    for run in runs:
        if run.get("status") != "ok" or run["role"] != "run":
            continue
        for base in (STOCK, "bf16"):
            ref = next((r for r in runs if r.get("status") == "ok" and r["role"] == "run"
                        and r["model"] == run["model"] and r["rate"] == run["rate"]
                        and r["setting"] == base), None)
            mine = _tta(run)
            theirs = _tta(ref) if ref else None
            run[f"speedup_vs_{base}"] = (theirs[0] / mine[0] if mine and theirs else None)
            run[f"speedup_vs_{base}_kind"] = (
                "measured" if mine and theirs and not (mine[1] or theirs[1]) else
                "projected" if mine and theirs else None)


def _tta(run):
    """(seconds to target, projected?) or None."""
    if run is None or run.get("status") != "ok":
        return None
    if run.get("reached"):
        return run["time_to_target_s"], False
    if run.get("projected_s"):
        return run["projected_s"], True
    return None


def render(report, args):
    runs = report["runs"]
    lines = [f"# Time to accuracy: Fashion-MNIST, {args.workers} workers, shaped links", "",
             f"`{report['command']}` ({report['started']}, {report['cpu_count']} cores). "
             "Each run trains with `model.fit` at the setting's recommended optimizer, rate "
             "and schedule (a warm-up of one epoch, at most a quarter of the run, then "
             "cosine over the run's epochs: "
             f"{args.epochs or 'the model default'} for stock and the settings of the "
             "dense schedule (bf16, 8-bit QSGD, auto), "
             + (f"{args.compressed_epochs} for the others"
                if args.compressed_epochs else
                "that times the setting's recommended epochs scale for the others")
             + f"), {args.batch_size} "
             "rows per worker and step, until worker 0's test accuracy (the whole test set, "
             f"every {args.eval_every:g} s of training) reaches the target or "
             + (f"{args.budget:g} s of training are spent (the floor runs: their schedule "
                "ends)" if args.rates else "the schedule ends (floor runs alone)")
             + ". Times: training only, from the end "
             "of the first (traced) step, evaluations left out (`first step`: its seconds, "
             "`auto`'s first measurement of the link and the CPU included). Target: the "
             f"stock strategy's final accuracy on a {rate_label(args.floor_rate)} link minus "
             f"{args.margin:g} point (the compute floor run). `sent/step`: what one worker "
             "sends per step (the strategy's own count; for stock, the ring all-reduce's "
             "2(N−1)/N of the gradients, and for a token embedding the all-gather of "
             "its rows, N−1 times a worker's tokens, each a row and an int32 index). "
             "Speed-ups: time to target of stock fp32 (or "
             "bf16) on the same link over the setting's. A run that spent its budget shows "
             "its best accuracy and, where the same setting reached the target on another "
             "link at step S, S × its median step time, marked *projected* (synchronous "
             "training computes the same steps at any link rate).", ""]
    for model in args.models:
        floor = next((r for r in runs if r["model"] == model and r["role"] == "floor"), None)
        target = target_for(args, runs, model)
        lines.append(f"## {model}")
        lines.append("")
        if floor and floor.get("status") == "ok":
            lines.append(
                f"Compute floor (stock, {rate_label(floor['rate'])}, {floor['epochs']} epochs): "
                f"final accuracy {floor['final_accuracy']:.4f}, best {floor['best_accuracy']:.4f}; "
                f"median step {floor['median_step_ms']:.0f} ms; target "
                + (f"{target:.4f}" if target is not None else "–") + "; time to target "
                + (f"{floor['time_to_target_s']:.0f} s (step {floor['steps_to_target']})"
                   if floor.get("reached") else "not reached") + ".")
        elif floor:
            lines.append(f"Floor run failed: {floor.get('reason', 'not run')}")
        lines.append("")
        floors = [r for r in runs if r["model"] == model and r["role"] == "floor_run"
                  and r.get("status") == "ok"]
        if floors:
            lines += [f"Compute floor of every setting ({rate_label(args.floor_rate)}, no "
                      "budget):", "",
                      "| setting | time to target | steps | step ms | final acc |",
                      "|:--|--:|--:|--:|--:|"]
            for r in [floor] + floors:
                if r is None or r.get("status") != "ok":
                    continue
                tta = (f"{r['time_to_target_s']:.0f} s" if r.get("reached")
                       else "not reached")
                steps = r["steps_to_target"] if r.get("reached") else r["steps"]
                lines.append(f"| {r['setting']} | {tta} | {steps} | {r['median_step_ms']:.0f} | "
                             f"{r['final_accuracy']:.4f} |")
            lines.append("")
        for rate in args.rates:
            lines += [f"### {rate_label(rate)}", "",
                      "| setting | compressor, optimizer | time to target | vs stock fp32 | "
                      "vs bf16 | steps | step ms | first step | sent/step | final acc | "
                      "best acc |",
                      "|:--|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
            for setting in args.settings:
                run = next((r for r in runs if r["model"] == model and r["rate"] == rate
                            and r["setting"] == setting and r["role"] == "run"), None)
                if run is None or run.get("status") is None:
                    continue
                if run["status"] != "ok":
                    lines.append(f"| {setting} | failed: {run.get('reason', '')[:120]} |"
                                 + " |" * 9)
                    continue
                if run["reached"]:
                    tta = f"{run['time_to_target_s']:.0f} s"
                elif run.get("projected_s"):
                    tta = (f"not reached in {run['train_s']:.0f} s (best "
                           f"{run['best_accuracy']:.4f}); ≈ {run['projected_s']:.0f} s projected")
                else:
                    tta = (f"not reached in {run['train_s']:.0f} s (best "
                           f"{run['best_accuracy']:.4f})")
                cells = []
                for base in (STOCK, "bf16"):
                    sp = run.get(f"speedup_vs_{base}")
                    cells.append("–" if sp is None else f"{sp:.2f}×" + (
                        " (projected)" if run.get(f"speedup_vs_{base}_kind") == "projected"
                        else ""))
                steps = run["steps_to_target"] if run["reached"] else run["steps"]
                lines.append(
                    f"| {setting} | {run['recommended'].replace('none, ', 'stock fp32, ', 1)} | "
                    f"{tta} | {cells[0]} | {cells[1]} | {steps} | {run['median_step_ms']:.0f} | "
                    f"{run['first_step_s']:.1f} s | {fmt_bytes(run['sent_bytes_per_step'])} | "
                    f"{run['final_accuracy']:.4f} | {run['best_accuracy']:.4f} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def write_plots(report, args):
    written = []
    for model in args.models:
        for rate in args.rates:
            series = []
            for run in report["runs"]:
                if (run["model"] == model and run["rate"] == rate and run["role"] == "run"
                        and run.get("status") == "ok"):
                    series.append((run["setting"], [(p["train_s"], p["test_accuracy"])
                                                    for p in run["curve"]]))
            if not series:
                continue
            path = f"{args.out}_{model}_{rate}.svg"
            with open(path, "w") as f:
                f.write(svg_plot(f"{model}, {args.workers} workers, {rate_label(rate)}: test "
                                 "accuracy against training time", "training time, s",
                                 "test accuracy", series))
            written.append(path)
    return written


def _drive(args, argv, holder):
    say = network.say
    status = network.shaped_start(holder, "time-to-accuracy benchmark skipped")
    if status is not None:
        return status
    done = {}
    if args.resume and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            done = {_key(r): r for r in json.load(f).get("runs", [])}
    runs = plan(args, done)
    command = _common.command_line("time_to_accuracy.py", argv)
    report = {"benchmark": "time_to_accuracy", "command": command,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
              "config": {k: getattr(args, k) for k in (
                  "models", "rates", "floor_rate", "settings", "workers", "epochs",
                  "compressed_epochs",
                  "batch_size", "learning_rate", "margin", "target", "budget", "eval_every",
                  "seed", "auto_every_steps")},
              "runs": runs, "complete": False}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    scratch = _common.scratch_dir("tfgc_tta_")
    say(f"time to accuracy: {len(runs)} runs, {args.workers} workers, worker logs under "
        f"{scratch}")
    cluster = holder["cluster"] = Cluster(args.workers).up()
    status = 0
    try:
        for k, run in enumerate(runs):
            label = f"[{k + 1}/{len(runs)}] {run['model']} {run['rate']:>7} {run['setting']}"
            if run.get("status") == "ok":
                say(f"{label}: kept from the earlier sweep")
                continue
            run["target"] = (None if run["role"] == "floor" and args.target is None
                             else target_for(args, runs, run["model"]))
            if run["role"] != "floor" and run["target"] is None:
                run.update(status="failed", reason="no target: the floor run failed")
                say(f"{label}: skipped: no target")
                continue
            cluster.set_rate(run["rate"])
            t0 = time.monotonic()
            try:
                result = run_once(cluster, run, args, os.path.join(scratch, f"run{k:03d}"),
                                  BASE_PORT + (k * 7) % 9000)
                run.update(result, status="ok")
            except network.RunFailed as exc:
                run.update(status="failed", reason=exc.reason, phase=exc.phase)
            except (OSError, ValueError, KeyError) as exc:
                run.update(status="failed", reason=f"driver: {type(exc).__name__}: {exc}")
            run["wall_s"] = time.monotonic() - t0
            if run["role"] == "floor" and run["status"] == "ok":
                # The floor run sets the target from its own end; when it first got there.
                target = target_for(args, runs, run["model"])
                hit = next((p for p in run["curve"] if p["test_accuracy"] >= target), None)
                run.update(target=target, reached=hit is not None,
                           time_to_target_s=hit["train_s"] if hit else None,
                           steps_to_target=hit["step"] if hit else None)
            add_projections(runs)
            if run["status"] == "ok":
                say(f"{label}: " + (f"target in {run['time_to_target_s']:.0f} s "
                                    f"(step {run['steps_to_target']})" if run["reached"]
                                    else f"final {run['final_accuracy']:.4f} after "
                                    f"{run['train_s']:.0f} s ({run['stop_reason']})")
                    + f", {run['median_step_ms']:.0f} ms/step, "
                    f"{fmt_bytes(run['sent_bytes_per_step'])}/step ({run['wall_s']:.0f} s)")
            else:
                say(f"{label}: failed: {run['reason']}")
            _common.write_json(args.out + ".json", report)
        report["complete"] = True
    except network.Interrupted as exc:
        network._STATE["cleaning"] = True
        status = 128 + exc.signum
        say(f"\ninterrupted by {signal.Signals(exc.signum).name}: stopping")
    except NetError as exc:
        network._STATE["cleaning"] = True
        status = 1
        say(f"\nerror building the shaped cluster: {exc}")
    cluster.down()
    holder["cluster"] = None
    add_projections(runs)
    _common.write_json(args.out + ".json", report)
    md = render(report, args)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    plots = write_plots(report, args)
    say()
    say(md)
    say(f"wrote {args.out}.md, {args.out}.json" + "".join(f", {p}" for p in plots))
    return status


def main(argv=None):
    return _common.main(argv, parse_args, worker_main,
                        lambda args, argv: network.driver_main(args, argv, drive=_drive))


if __name__ == "__main__":
    sys.exit(main())
