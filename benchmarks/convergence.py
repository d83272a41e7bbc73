"""Convergence: test accuracy against bytes sent and wall time, every compressor vs dense.

    python benchmarks/convergence.py                        # the full sweep (hours: see benchmarks/README.md)
    python benchmarks/convergence.py --quick                # smoke run: 2 workers, 1 x 40 steps
    python benchmarks/convergence.py --models mlp --compressors none onebit dgc --epochs 5
    python benchmarks/convergence.py --resume               # go on with an interrupted sweep

Fashion-MNIST, 4 workers, batch 64 per worker, the MLP and the CNN of ``tfgc.apps.models``.
Every compressor runs at its paper's default with the optimizer its paper recommends
(the ``SETTINGS`` table below says which and why), for enough epochs that dense SGD
has converged. Each (model, compressor) is one local cluster of its own, started through
``tfgc.apps.launch``; the script is its own worker (the driver relaunches it with
``--worker``; only the workers import TensorFlow). Each worker trains with ``model.fit``
and evaluates the whole test set after every epoch (Keras ``validation_data``); a
callback records, per epoch, the test accuracy, the bytes this worker has sent so far
(``strategy.compression_stats()['total_sent_bytes']``) and the training time so far
(the evaluations left out). Worker 0 writes them as JSON.

Outputs (``--out PREFIX``, default ``benchmarks/results/convergence``):
PREFIX.md (the table), PREFIX.json (configuration, settings, every run's curve),
PREFIX_curves.csv (the curves, one row per epoch), and per model two plots,
PREFIX_<model>_bytes and PREFIX_<model>_time: PNG through matplotlib when it is
installed, otherwise SVG written by hand (no plotting dependency).
"""

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
from tfgc.apps.plots import fmt_bytes, svg_plot  # noqa: E402

DEFAULT_OUT = os.path.join(_common.RESULTS_DIR, "convergence")
QUICK_OUT = os.path.join(_common.RESULTS_DIR, "convergence_quick")
BASE_LR = 0.05  # the trainer's default rate, with momentum 0.9 the dense reference

# ---------------------------------------------------------------------------------
# Per-compressor settings: spec at the paper's default, the optimizer the paper uses
# (as `tfgc.apps.train.make_optimizer` names them: "momentum" is SGD with momentum 0.9, or
# plain SGD when the compressor applies the momentum itself on the workers; "sgd" is
# plain SGD), the learning rate, and where the setting comes from. `{steps_per_epoch}`
# in a spec is filled in by the worker. "covers" is the registry name the entry stands
# for. Entries with default=False run only when named in --compressors.
#
# Accuracy figures quoted below: tests/test_distributed.py (MAX_LOSS comment: MLP on
# MNIST-5k, 2 workers, 2 epochs, dense 0.866) and docs/results.md (Fashion-
# MNIST MLP, 4 workers, 2 epochs, batch 64 per worker).
SETTINGS = [
    dict(label="none", covers="none", spec="none", optimizer="momentum", lr=BASE_LR,
         source="dense reference: heavy-ball momentum SGD (m = 0.9), the baseline of every "
                "paper here; bit-identical to stock MultiWorkerMirroredStrategy"),
    dict(label="none/sgd", covers=None, spec="none", optimizer="sgd", lr=BASE_LR,
         source="dense with plain SGD: the reference for the entries that train with plain "
                "SGD and no worker-side momentum (ef+topk, ef+randomk, signsgd)"),
    dict(label="fp16", covers="fp16", spec="fp16", optimizer="momentum", lr=BASE_LR,
         source="half-precision all-reduce (no paper of its own): the dense optimizer; "
                "tests: 0.886 vs 0.866 dense"),
    dict(label="bf16", covers="bf16", spec="bf16", optimizer="momentum", lr=BASE_LR,
         source="bfloat16 all-reduce (no paper of its own): the dense optimizer; "
                "tests: 0.884 vs 0.866 dense"),
    dict(label="topk", covers="topk", spec="topk:ratio=0.01", optimizer="momentum",
         lr=BASE_LR,
         source="top-k without memory at tfgc's default 1 %, momentum SGD as in the "
                "sweep's measurement (tests: 0.812 vs 0.866 dense)"),
    dict(label="ef+topk", covers="ef", spec="ef+topk:ratio=0.001", optimizer="sgd",
         lr=BASE_LR,
         source="error feedback (Stich, Cordonnier & Jaggi 2018, memory SGD: plain SGD) "
                "around top-k at DGC's 0.1 % density; tests: 0.790 (without memory 0.416)"),
    dict(label="ef+randomk", covers="randomk", spec="ef+randomk:ratio=0.01", optimizer="sgd",
         lr=BASE_LR,
         source="random-k with memory (Stich et al. 2018: plain SGD) at tfgc's default 1 %; "
                "without memory it does not learn at 1 % (tests: 0.156, with memory 0.738)"),
    dict(label="onebit", covers="onebit", spec="onebit:momentum=0.9", optimizer="sgd",
         lr=BASE_LR,
         source="1-bit SGD (Seide et al. 2014) with momentum 0.9 applied on the workers "
                "before compression (momentum correction), plain SGD in the optimizer; "
                "README: 0.784 on the reduce-scatter at 4 workers (heavy-ball: 0.690)"),
    dict(label="signsgd", covers="signsgd", spec="signsgd", optimizer="sgd", lr=0.002,
         source="signSGD with majority vote (Bernstein et al. 2018): plain SGD, small rate "
                "since every coordinate moves by the full step; tests: lr 0.002, 0.884"),
    dict(label="efsignsgd", covers="efsignsgd", spec="efsignsgd:momentum=0.9",
         optimizer="sgd", lr=0.01,
         source="EF-signSGD (Karimireddy et al. 2019) with momentum correction, plain SGD; "
                "rate scaled down for the ~1/(1-m) gradients in u: README measured 0.785 at "
                "lr 0.01 vs 0.601 at 0.05 (reduce-scatter, 4 workers)"),
    dict(label="qsgd", covers="qsgd", spec="qsgd:levels=127,bucket_size=512",
         optimizer="momentum", lr=BASE_LR,
         source="QSGD (Alistarh et al. 2017) 8 bits, bucket 512: the paper's full-accuracy "
                "setting, momentum SGD as in its experiments; tests: 0.888"),
    dict(label="qsgd-4bit", covers=None, spec="qsgd:levels=7,bucket_size=128",
         optimizer="momentum", lr=BASE_LR, default=False,
         source="QSGD 4 bits, bucket 128 (the paper's 4-bit variant); tests: 0.876"),
    dict(label="terngrad", covers="terngrad", spec="terngrad:clip=2.5", optimizer="momentum",
         lr=BASE_LR,
         source="TernGrad (Wen et al. 2017): 2.5-sigma clipping, the optimizer of the dense "
                "baseline (momentum SGD); tests: 0.886"),
    dict(label="dgc", covers="dgc", spec="dgc:ratio=0.001,warmup_steps={steps_per_epoch}",
         optimizer="momentum", lr=BASE_LR,
         source="DGC (Lin et al. 2018): 99.9 % sparsity, momentum 0.9 with momentum "
                "correction and factor masking on the workers (the trainer compiles plain "
                "SGD), warm-up one stage per epoch (25 %, 6.25 %, 1.56 %, 0.39 %) as the "
                "paper's code; tests: 0.752 after 4 x 20 warm-up steps"),
    dict(label="importance", covers="importance", spec="importance:ratio=0.01,eps=1e-06",
         optimizer="momentum", lr=BASE_LR,
         source="importance-weighted pruning (Cheng & Xu 2019): 1 %, eps 1e-6, error "
                "feedback, momentum SGD like the other sparsifiers with memory measured "
                "with it (graddrop); not measured before"),
    dict(label="powersgd", covers="powersgd", spec="powersgd:rank=2", optimizer="momentum",
         lr=BASE_LR,
         source="PowerSGD (Vogels et al. 2019): rank 2, warm start, error feedback; the "
                "momentum stays in the optimizer as in the paper; tests: 0.812"),
    dict(label="graddrop", covers="graddrop", spec="graddrop:drop_ratio=0.99",
         optimizer="momentum", lr=BASE_LR,
         source="gradient dropping (Aji & Heafield 2017): 99 % dropped per layer, error "
                "feedback, momentum SGD; tests: 0.822 (scope=global 0.842)"),
    dict(label="threshold", covers="threshold", spec="threshold:tau=0.01,max_density=0.01",
         optimizer="momentum", lr=BASE_LR,
         source="Strom 2015: fixed threshold tau = 0.01 (tfgc's default, not tuned to this "
                "model), error feedback, momentum SGD; not measured before"),
    dict(label="adaptive", covers="adaptive", spec="adaptive:proportion=100",
         optimizer="momentum", lr=BASE_LR,
         source="adaptive quantization (Dryden et al. 2016): pi = 100, error feedback, "
                "momentum SGD; tests comment: 0.748"),
    dict(label="fft", covers="fft", spec="fft:theta=0.9,bits=8", optimizer="momentum",
         lr=BASE_LR,
         source="FFT sparsification (Wang et al. 2020): 90 % of the coefficients dropped, "
                "8-bit range-based floats, no error feedback (as the paper), momentum SGD; "
                "not measured before"),
    dict(label="variance", covers="variance", spec="variance:alpha=2.0,zeta=0.999",
         optimizer="momentum", lr=BASE_LR,
         source="variance-based compression (Tsuzuku, Imachi & Akiba 2018): alpha = 2, "
                "zeta = 0.999, 4-bit values; the model's dense layers become MomentDense "
                "(as tfgc-train does); momentum SGD like the other delayed-update "
                "sparsifiers; not measured before"),
    dict(label="gradiveq", covers="gradiveq", spec="gradiveq:dense_layers=true",
         optimizer="momentum", lr=BASE_LR,
         source="GradiVeQ (Yu et al. 2018): K = 768, lambda = 0.01, d' = 96, windows of 100 "
                "learning + 400 compressed steps, no error feedback, momentum SGD as the "
                "paper's ResNet runs; dense_layers=true, since the paper leaves fully-"
                "connected layers uncompressed and the MLP has nothing else"),
    dict(label="stock", covers=None, spec="stock", optimizer="momentum", lr=BASE_LR,
         default=False,
         source="stock tf.distribute.MultiWorkerMirroredStrategy (bytes: the ring formula)"),
]
SETTINGS_BY_LABEL = {s["label"]: s for s in SETTINGS}
# Registry names that need no entry of their own: `scaledsign` from a string is
# `ef+scaledsign`, i.e. `efsignsgd`; `ef` is the wrapper (its entry: ef+topk).
REGISTRY_COVERED = {"scaledsign": "efsignsgd"}
DENSE = "none"
DENSE_SGD = "none/sgd"
# Registry names of the compressors that keep what they did not send for later steps
# (error feedback: 1-bit SGD and EF-signSGD through the `ef+` wrapper, and the ones
# that keep a residual of their own); any `ef+...` spec has it too. The goal,
# within GOAL_POINTS of dense, is set for these. tests/test_convergence_report.py
# checks this against the registry's compressors.
ERROR_FEEDBACK = frozenset({"onebit", "efsignsgd", "scaledsign", "dgc", "importance",
                            "powersgd", "graddrop", "threshold", "adaptive", "variance"})
GOAL_POINTS = 0.5
QUICK_COMPRESSORS = ["none", "onebit", "dgc"]

# Epochs per model: those of the stored results (benchmarks/results/convergence.json).
# Global batch 256 (4 x 64), 234 steps per epoch. Measured with dense momentum SGD (lr
# 0.05) on Fashion-MNIST: the MLP reaches 0.862 after 8 epochs, 0.3 point above the
# best epoch before the last three; the CNN peaks at 0.891 in epoch 8 of 10. The report
# checks this on the dense run itself (see `convergence_note`) and says when it had not
# converged.
DEFAULT_EPOCHS = {"mlp": 8, "cnn": 10}
TRAIN_EXAMPLES = {"fashion_mnist": 60000, "mnist5k": 4000, "synthetic": 4096}
# Seconds per step that a run may take before it is given up (generous: 5-10x the
# expected on a busy 2-core machine), for the default --timeout.
TIMEOUT_PER_STEP = {"mlp": 0.5, "cnn": 3.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=None, help="workers per cluster (default 4)")
    p.add_argument("--models", nargs="+", choices=["mlp", "cnn"], default=None,
                   help="default: mlp cnn")
    p.add_argument("--epochs", default=None,
                   help="epochs: one number for every model, or per model as 'mlp=20,cnn=15' "
                        f"(default {','.join(f'{k}={v}' for k, v in DEFAULT_EPOCHS.items())})")
    p.add_argument("--compressors", nargs="+", default=None,
                   help="labels of the settings table (see --list), registry names, or raw "
                        "specs (momentum SGD, lr 0.05); default: every default entry plus "
                        "any registry name the table does not cover")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 workers, 1 epoch of 40 steps, mlp, "
                        f"{' '.join(QUICK_COMPRESSORS)}; writes {QUICK_OUT}.* by default")
    p.add_argument("--steps_per_epoch", type=int, default=None,
                   help="cap on steps per epoch (default: a full shard, 0 = no cap)")
    p.add_argument("--batch_size", type=int, default=64, help="per worker (default 64)")
    p.add_argument("--dataset", choices=["fashion_mnist", "mnist5k", "synthetic"],
                   default="fashion_mnist")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--communication", default="auto",
                   help="the strategy's communication (default auto)")
    p.add_argument("--min_elements", type=int, default=1024,
                   help="compression policy: smaller gradients are sent dense")
    p.add_argument("--threads", type=int, default=-1,
                   help="intra/inter-op threads per worker; -1 (default): cores // workers "
                        "(at least 1); 0: TensorFlow's default")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds per run; 0 (default): 300 + steps x "
                        f"{TIMEOUT_PER_STEP} per model")
    p.add_argument("--resume", action="store_true",
                   help="keep the successful runs of PREFIX.json that have the same settings "
                        "and run only the rest")
    p.add_argument("--list", action="store_true", help="print the settings table and exit")
    p.add_argument("--out", default=None,
                   help=f"output prefix (default {DEFAULT_OUT}; with --quick {QUICK_OUT})")
    # Worker-only arguments.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--optimizer", help=argparse.SUPPRESS)
    p.add_argument("--learning_rate", type=float, help=argparse.SUPPRESS)
    p.add_argument("--run_epochs", type=int, help=argparse.SUPPRESS)
    p.add_argument("--json_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.quick:
        args.workers = args.workers or 2
        args.models = args.models or ["mlp"]
        args.epochs = args.epochs or "1"
        args.steps_per_epoch = 40 if args.steps_per_epoch is None else args.steps_per_epoch
        args.compressors = args.compressors or list(QUICK_COMPRESSORS)
        args.out = args.out or QUICK_OUT
    args.workers = args.workers or 4
    args.models = args.models or ["mlp", "cnn"]
    args.steps_per_epoch = args.steps_per_epoch or 0
    args.out = args.out or DEFAULT_OUT
    if args.out.endswith(".json") or args.out.endswith(".md"):
        args.out = os.path.splitext(args.out)[0]
    if args.workers < 1 or args.batch_size < 1 or args.steps_per_epoch < 0:
        p.error("--workers and --batch_size must be >= 1, --steps_per_epoch >= 0")
    try:
        args.epochs_by_model = parse_epochs(args.epochs, args.models)
    except ValueError as exc:
        p.error(str(exc))
    if args.threads < 0:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    return args


def parse_epochs(text, models):
    if not text:
        return {m: DEFAULT_EPOCHS[m] for m in models}
    if "=" not in text:
        n = int(text)
        if n < 1:
            raise ValueError("--epochs must be >= 1")
        return {m: n for m in models}
    got = dict(DEFAULT_EPOCHS)
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in DEFAULT_EPOCHS or int(value) < 1:
            raise ValueError(f"bad --epochs item {item!r}: expected MODEL=N, N >= 1")
        got[key.strip()] = int(value)
    return {m: got[m] for m in models}


def steps_per_epoch(train_examples, workers, batch_size, cap):
    """As tfgc.apps.train.train_and_evaluate: the same number of full batches on every worker."""
    steps = (train_examples // workers) // batch_size
    return min(steps, cap) if cap else steps


# ---------------------------------------------------------------------------------
# Worker: one cluster member, trains one (model, compressor) and records its curve.

def worker_main(args):
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    import tfgc
    from tfgc.apps import data as data_lib
    from tfgc.apps import models
    from tfgc.apps.train import make_optimizer, make_step_timer, worker_info

    ds = data_lib.load_dataset(args.dataset, seed=args.seed)
    steps = steps_per_epoch(len(ds.x_train), args.workers, args.batch_size, args.steps_per_epoch)
    if steps < 1:
        raise SystemExit(f"batch {args.batch_size} is larger than a worker's shard")
    stock = args.spec == "stock"
    spec = args.spec.format(steps_per_epoch=steps)
    if stock:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
            compressor=spec, policy=tfgc.CompressionPolicy(min_elements=args.min_elements),
            communication=args.communication)
    keras.utils.set_random_seed(args.seed)
    rank, num_workers = worker_info(strategy)
    if num_workers != args.workers:
        raise SystemExit(f"cluster has {num_workers} workers, expected {args.workers}")

    # The same data pipeline as tfgc.apps.train.train_and_evaluate.
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, num_workers)
    train_ds = data_lib.make_tf_dataset(x, y, args.batch_size, seed=args.seed + rank,
                                        repeat=True, workers=num_workers)
    test_ds = data_lib.make_tf_dataset(ds.x_test, ds.y_test, 500, shuffle=False,
                                       drop_remainder=False)
    compressor = getattr(strategy, "compressor", None)
    # As tfgc.apps.train: a compressor that reads per-sample second moments (variance)
    # needs the model's dense layers built as tfgc.keras.MomentDense.
    extra = {"moments": True} if getattr(compressor, "needs_second_moment", False) else {}
    with strategy.scope():
        net = models.build_model(args.model, input_shape=ds.x_train.shape[1:],
                                 num_classes=ds.num_classes, seed=args.seed, **extra)
        optimizer = make_optimizer(args.optimizer, args.learning_rate, compressor)
        net.compile(optimizer=optimizer,
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    dense_bytes = sum(int(np.prod(v.shape)) * v.dtype.size for v in net.trainable_variables)
    ring = 2 * (num_workers - 1) * dense_bytes // num_workers

    def stats():
        if stock:  # the stock ring all-reduce keeps no account: its formula
            return None
        return strategy.compression_stats()

    class EpochRecorder(keras.callbacks.Callback):
        """Per epoch: test accuracy (the validation pass), bytes sent, training time."""

        def __init__(self):
            super().__init__()
            self.curve = []
            self.train_seconds = 0.0
            self.base = None
            self.t0 = self.t_end = None

        def on_train_begin(self, logs=None):
            self.base = stats()

        def on_epoch_begin(self, epoch, logs=None):
            self.t0, self.t_end = time.perf_counter(), None

        def on_test_begin(self, logs=None):
            # The epoch's training ends where its evaluation begins.
            if self.t_end is None:
                self.t_end = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            end = self.t_end if self.t_end is not None else time.perf_counter()
            self.train_seconds += end - self.t0
            logs = logs or {}
            point = {"epoch": epoch + 1, "train_seconds": self.train_seconds,
                     "test_accuracy": float(logs.get("val_accuracy", float("nan"))),
                     "test_loss": float(logs.get("val_loss", float("nan"))),
                     "train_accuracy": float(logs.get("accuracy", float("nan"))),
                     "train_loss": float(logs.get("loss", float("nan")))}
            now = stats()
            if now is None:
                done = (epoch + 1) * steps
                point.update(reductions=done, cumulative_sent_bytes=done * ring,
                             cumulative_payload_bytes=done * dense_bytes)
            else:
                point.update(
                    reductions=now["steps"] - self.base["steps"],
                    cumulative_sent_bytes=now["total_sent_bytes"] - self.base["total_sent_bytes"],
                    cumulative_payload_bytes=(now["total_payload_bytes"]
                                              - self.base["total_payload_bytes"]))
            self.curve.append(point)

    timer = make_step_timer()
    recorder = EpochRecorder()
    start = time.perf_counter()
    net.fit(train_ds, epochs=args.run_epochs, steps_per_epoch=steps, validation_data=test_ds,
            callbacks=[timer, recorder], verbose=0)
    fit_seconds = time.perf_counter() - start

    durations = np.asarray(timer.durations) * 1e3
    kept = durations[5:] if len(durations) > 5 else durations
    final = stats()
    if final is None:
        final = {"dense_bytes": dense_bytes, "payload_bytes": dense_bytes, "sent_bytes": ring,
                 "received_bytes": ring, "dense_sent_bytes": ring, "ratio": 1.0,
                 "wire_ratio": 1.0 if ring else 0.0, "nonfinite_steps": 0}
    path = "ring all-reduce (stock)" if stock else None
    if not stock:
        try:  # the path communication="auto" chose (private; for the record only)
            path = strategy.cross_device_ops._path()  # pylint: disable=protected-access
        except Exception:  # noqa: BLE001
            path = None
    curve = recorder.curve
    result = {
        "spec": spec, "model": args.model, "dataset": ds.name, "workers": num_workers,
        "rank": rank, "batch_size": args.batch_size, "epochs": args.run_epochs,
        "steps_per_epoch": steps, "optimizer": args.optimizer,
        "learning_rate": args.learning_rate,
        "optimizer_momentum": float(getattr(optimizer, "momentum", 0.0) or 0.0),
        "compressor_momentum": float(getattr(compressor, "applied_momentum", 0.0) or 0.0),
        "communication": path,
        "curve": curve,
        "final_accuracy": curve[-1]["test_accuracy"] if curve else float("nan"),
        "best_accuracy": max((c["test_accuracy"] for c in curve), default=float("nan")),
        "dense_bytes_per_step": int(final["dense_bytes"]),
        "payload_bytes_per_step": int(final["payload_bytes"]),
        "sent_bytes_per_step": int(final["sent_bytes"]),
        "dense_sent_bytes_per_step": int(final["dense_sent_bytes"]),
        "ratio": float(final["ratio"]), "wire_ratio": float(final["wire_ratio"]),
        "nonfinite_steps": int(final.get("nonfinite_steps", 0)),
        "total_sent_bytes": curve[-1]["cumulative_sent_bytes"] if curve else 0,
        "reductions": curve[-1]["reductions"] if curve else 0,
        "median_step_ms": float(np.median(kept)) if len(kept) else float("nan"),
        "p10_step_ms": float(np.percentile(kept, 10)) if len(kept) else float("nan"),
        "p90_step_ms": float(np.percentile(kept, 90)) if len(kept) else float("nan"),
        "train_seconds": recorder.train_seconds, "fit_seconds": fit_seconds,
    }
    if rank == 0:
        with open(args.json_out, "w") as f:
            json.dump(result, f)
    print(f"done {spec} on {args.model}: accuracy {result['final_accuracy']:.4f}", flush=True)


# ---------------------------------------------------------------------------------
# Driver.

def registry_names():
    """The compressor registry's names, read in a subprocess (the driver stays TF-free)."""
    code = "import json, tfgc.compressors.registry as r; print('NAMES ' + json.dumps(r.names()))"
    env = dict(os.environ, **_common.worker_env())
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300, check=True).stdout
        for line in out.splitlines():
            if line.startswith("NAMES "):
                return json.loads(line[6:]), None
        return None, "no output"
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def resolve_entries(requested, names):
    """The settings to run, and notes about how the registry's names were covered."""
    notes = []
    by_cover = {s["covers"]: s for s in SETTINGS if s["covers"]}
    if requested is None:
        entries = [s for s in SETTINGS if s.get("default", True)]
        if names is not None:
            for name in names:
                if name in by_cover or name in REGISTRY_COVERED:
                    continue
                entries.append(dict(label=name, covers=name, spec=name, optimizer="momentum",
                                    lr=BASE_LR, source="not in the curated table: the "
                                    "registry's defaults with momentum SGD"))
                notes.append(f"registry name {name!r} has no entry in SETTINGS: runs at its "
                             "defaults with momentum SGD, lr 0.05")
        return entries, notes
    entries = []
    for item in requested:
        if item in SETTINGS_BY_LABEL:
            entries.append(SETTINGS_BY_LABEL[item])
        elif item in by_cover:
            entries.append(by_cover[item])
        elif item in REGISTRY_COVERED:
            entries.append(SETTINGS_BY_LABEL[REGISTRY_COVERED[item]])
            notes.append(f"{item!r} runs as {REGISTRY_COVERED[item]!r}")
        else:
            entries.append(dict(label=item, covers=None, spec=item, optimizer="momentum",
                                lr=BASE_LR, source="given on the command line: momentum SGD"))
    seen, unique = set(), []
    for e in entries:
        if e["label"] not in seen:
            seen.add(e["label"])
            unique.append(e)
    return unique, notes


def run_key(run):
    return json.dumps([run[k] for k in ("model", "label", "spec_template", "optimizer",
                                        "learning_rate", "epochs", "workers",
                                        "steps_per_epoch_cap", "batch_size", "dataset", "seed",
                                        "min_elements", "communication_arg")])


def plan_runs(args, entries):
    runs = []
    for model in args.models:
        for e in entries:
            runs.append({"model": model, "label": e["label"], "spec_template": e["spec"],
                         "optimizer": e["optimizer"], "learning_rate": e["lr"],
                         "source": e["source"], "epochs": args.epochs_by_model[model],
                         "workers": args.workers, "steps_per_epoch_cap": args.steps_per_epoch,
                         "batch_size": args.batch_size, "dataset": args.dataset,
                         "seed": args.seed, "min_elements": args.min_elements,
                         "communication_arg": args.communication})
    return runs


def run_one(command, num_workers, json_path, timeout, log):
    """(worker 0's JSON, None), or (None, a one-line reason) when the run failed.

    A Ctrl-C or SIGTERM (which the launcher forwards to the workers) ends the sweep:
    it is raised as KeyboardInterrupt rather than recorded as a failed run."""
    from tfgc.apps.launch import TIMEOUT_EXIT_CODE, launch

    if os.path.exists(json_path):
        os.remove(json_path)
    result = launch(command, num_workers, env=_common.worker_env(), timeout=timeout, output=log)
    log.flush()
    if result.ok and os.path.exists(json_path):
        with open(json_path) as f:
            return json.load(f), None
    if result.ok:
        return None, "worker 0 wrote no results"
    if result.returncode == TIMEOUT_EXIT_CODE and result.failed_worker is None:
        return None, f"timed out after {timeout:.0f} s"
    if result.failed_worker is None and result.returncode in (128 + 2, 128 + 15):
        raise KeyboardInterrupt
    lines = [ln.strip() for ln in (result.message or "").splitlines() if ln.strip()]
    reason = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln),
                  lines[0] if lines else f"exit {result.returncode}")
    return None, f"worker {result.failed_worker} exit {result.returncode}: {reason}"[:300]


def worker_command(args, run, json_path):
    return [sys.executable, os.path.abspath(__file__), "--worker",
            "--model", run["model"], "--spec", run["spec_template"],
            "--optimizer", run["optimizer"], "--learning_rate", repr(run["learning_rate"]),
            "--run_epochs", str(run["epochs"]), "--workers", str(run["workers"]),
            "--steps_per_epoch", str(run["steps_per_epoch_cap"]),
            "--batch_size", str(run["batch_size"]), "--dataset", run["dataset"],
            "--seed", str(run["seed"]), "--min_elements", str(run["min_elements"]),
            "--communication", run["communication_arg"], "--threads", str(args.threads),
            "--json_out", json_path]


def run_timeout(args, run):
    if args.timeout:
        return args.timeout
    steps = steps_per_epoch(TRAIN_EXAMPLES[run["dataset"]], run["workers"], run["batch_size"],
                            run["steps_per_epoch_cap"])
    return 300 + run["epochs"] * steps * TIMEOUT_PER_STEP[run["model"]] * max(1, run["workers"] / 4)


def driver_main(args):
    names, why = (None, None)
    if args.compressors is None:
        names, why = registry_names()
    entries, notes = resolve_entries(args.compressors, names)
    if args.compressors is None and names is None:
        notes.append(f"could not read the registry ({why}): ran the table's entries only")
    if args.list:
        print_settings(entries)
        for n in notes:
            print("note: " + n)
        return 0

    runs = plan_runs(args, entries)
    previous = {}
    if args.resume and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            for r in json.load(f).get("runs", []):
                if r.get("status") == "ok":
                    previous[run_key(r)] = r
    scratch = _common.scratch_dir("tfgc_convergence_")
    log_path = os.path.join(scratch, "workers.log")
    epochs_text = ", ".join(f"{m} {n}" for m, n in args.epochs_by_model.items())
    print(f"convergence: {len(runs)} runs ({len(entries)} settings x {len(args.models)} "
          f"model(s)); {args.workers} workers, {args.dataset}, batch {args.batch_size}/worker, "
          f"epochs: {epochs_text}"
          + (f", at most {args.steps_per_epoch} steps/epoch" if args.steps_per_epoch else "")
          + f", {args.threads or 'default'} thread(s) per worker pool")
    for n in notes:
        print("note: " + n)
    print(f"worker output: {log_path}\n", flush=True)

    report = {"benchmark": "convergence", "complete": False,
              "config": {"workers": args.workers, "models": args.models,
                         "epochs": args.epochs_by_model, "dataset": args.dataset,
                         "batch_size": args.batch_size, "steps_per_epoch": args.steps_per_epoch,
                         "seed": args.seed, "communication": args.communication,
                         "min_elements": args.min_elements, "threads": args.threads,
                         "quick": args.quick},
              "cpu_count": os.cpu_count(), "notes": notes, "registry_names": names,
              "settings": entries, "runs": []}
    started = time.monotonic()
    done_seconds = []
    interrupted = False
    try:
        with open(log_path, "w") as log:
            for i, run in enumerate(runs):
                key = run_key(run)
                if key in previous:
                    report["runs"].append(previous[key])
                    print(f"[{i + 1}/{len(runs)}] {run['model']} {run['label']}: kept from "
                          f"{args.out}.json", flush=True)
                    continue
                json_path = os.path.join(scratch, f"run{i}.json")
                log.write(f"\n===== {run['model']} {run['label']} ({run['spec_template']}) =====\n")
                log.flush()
                load = os.getloadavg()[0]
                t0 = time.monotonic()
                out = dict(run, load_before=load)
                got, reason = run_one(worker_command(args, run, json_path), args.workers,
                                      json_path, run_timeout(args, run), log)
                if got is not None:
                    # The worker's figures; the planned keys (the resume key) stay as planned.
                    out.update({k: v for k, v in got.items() if k not in run}, status="ok")
                else:
                    out.update(status="failed", reason=reason)
                out["cluster_seconds"] = time.monotonic() - t0
                done_seconds.append(out["cluster_seconds"])
                report["runs"].append(out)
                left = len(runs) - i - 1
                eta = _common.median(done_seconds) * left
                if out["status"] == "ok":
                    msg = (f"accuracy {out['final_accuracy']:.4f}, sent/step "
                           f"{fmt_bytes(out['sent_bytes_per_step'])}, step "
                           f"{out['median_step_ms']:.1f} ms")
                else:
                    msg = f"failed: {out['reason']}"
                print(f"[{i + 1}/{len(runs)}] {run['model']} {run['label']}: {msg} "
                      f"({out['cluster_seconds']:.0f} s; about {eta / 60:.0f} min left)",
                      flush=True)
                write_outputs(report, args, quiet=True)  # a sweep cut short keeps what it had
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: writing the runs so far", flush=True)

    report["complete"] = not interrupted and len(report["runs"]) == len(runs)
    report["wall_seconds"] = time.monotonic() - started
    write_outputs(report, args, quiet=False)
    print(f"total wall time {report['wall_seconds']:.0f} s")
    failed = [r for r in report["runs"] if r.get("status") != "ok"]
    return 1 if failed or interrupted else 0


def print_settings(entries):
    print("| label | spec | optimizer | lr | source |")
    print("|:--|:--|:--|--:|:--|")
    for e in entries:
        print(f"| {e['label']} | `{e['spec']}` | {e['optimizer']} | {e['lr']:g} | {e['source']} |")


# ---------------------------------------------------------------------------------
# Outputs.

def optimizer_text(run):
    if run.get("status") != "ok":
        return f"{run['optimizer']} {run['learning_rate']:g}"
    m_opt, m_comp = run.get("optimizer_momentum", 0.0), run.get("compressor_momentum", 0.0)
    if m_comp:
        what = f"SGD, m={m_comp:g} on workers"
    elif m_opt:
        what = f"SGD m={m_opt:g}"
    else:
        what = "SGD"
    return f"{what}, lr {run['learning_rate']:g}"


def dense_by_model(runs):
    return {r["model"]: r for r in runs if r["label"] == DENSE and r.get("status") == "ok"}


def has_error_feedback(spec):
    """Whether the compressor a spec names keeps what it did not send (ERROR_FEEDBACK)."""
    name = spec.strip().split(":", 1)[0]
    return name.startswith("ef+") or name in ERROR_FEEDBACK


def reference_label(run):
    """The dense run a setting is judged against: dense with plain SGD (``none/sgd``) for
    the settings that train with no momentum anywhere (memory SGD, signSGD); dense
    momentum SGD (``none``) for the rest, the compressors that apply the momentum on
    the workers included (their update is momentum SGD's)."""
    plain = not run.get("optimizer_momentum") and not run.get("compressor_momentum")
    return DENSE_SGD if plain and run["label"] != DENSE_SGD else DENSE


def tail_mean(run, epochs=3):
    """Mean test accuracy of the last ``epochs`` epochs (NaN without any): less noisy
    than the last one alone under a constant learning rate."""
    acc = [c["test_accuracy"] for c in run.get("curve", [])][-epochs:]
    return sum(acc) / len(acc) if acc else float("nan")


def goal_rows(report):
    """Per setting and model: the accuracies against the setting's dense reference.

    Returns [(label, error_feedback, {model: None (not run) or {"reference": label,
    "final", "tail", "delta", "tail_delta"}}), ...] in the sweep's order; deltas in
    points, None when the reference has no successful run."""
    ok = [r for r in report["runs"] if r.get("status") == "ok"]
    by = {(r["model"], r["label"]): r for r in ok}
    models = [m for m in report["config"]["models"] if any(r["model"] == m for r in ok)]
    rows = []
    for label in dict.fromkeys(r["label"] for r in ok):
        per_model, spec = {}, None
        for model in models:
            run = by.get((model, label))
            if run is None:
                per_model[model] = None
                continue
            spec = run.get("spec") or run["spec_template"]
            ref_label = reference_label(run)
            ref = by.get((model, ref_label))
            final, tail = run["final_accuracy"], tail_mean(run)
            per_model[model] = {
                "reference": ref_label, "final": final, "tail": tail,
                "delta": None if ref is None else 100 * (final - ref["final_accuracy"]),
                "tail_delta": None if ref is None else 100 * (tail - tail_mean(ref))}
        rows.append((label, has_error_feedback(spec), per_model))
    return rows


def goal_verdict(error_feedback, per_model):
    """'met', 'missed on <models>', with '<model>: no reference' for the models whose
    reference did not run (never 'met' for those), or '(no error feedback)'."""
    if not error_feedback:
        return "(no error feedback)"
    judged = {m: got["delta"] for m, got in per_model.items()
              if got is not None and got["delta"] is not None}
    unjudged = [m for m, got in per_model.items() if got is not None and got["delta"] is None]
    missed = [m for m, d in judged.items() if d < -GOAL_POINTS]
    parts = []
    if missed:
        parts.append("missed on " + ", ".join(missed))
    elif judged:
        parts.append("met" + (" on " + ", ".join(judged) if unjudged else ""))
    parts += [f"{m}: no reference" for m in unjudged]
    return "; ".join(parts) or "–"


def render_goal_table(report):
    """Markdown lines: every setting against its own dense reference, per model."""
    rows = goal_rows(report)
    models = [m for m in report["config"]["models"] if any(r[2].get(m) for r in rows)]
    if not models:
        return []
    lines = [f"## Against dense (goal: within {GOAL_POINTS:g} point for error feedback)", "",
             "Δ: points against the setting's reference, the dense run with the same kind "
             "of optimizer (`none/sgd` without momentum anywhere, else `none`), on the "
             "same model; final epoch, and the mean of the last three epochs (less noisy "
             "under a constant learning rate). Goal: met when the final Δ is at least "
             f"−{GOAL_POINTS:g}.", ""]
    head = "| compressor | error feedback |"
    rule = "|:--|:--|"
    for m in models:
        head += f" {m} reference | {m} final (Δ) | {m} last 3 (Δ) |"
        rule += ":--|--:|--:|"
    lines += [head + " goal |", rule + ":--|"]

    def cell(value, delta):
        if math.isnan(value):
            return "–"
        return f"{value:.4f}" + ("" if delta is None else f" ({delta:+.2f})")

    for label, ef, per_model in rows:
        if label in (DENSE, DENSE_SGD):
            continue
        line = f"| {label} | {'yes' if ef else 'no'} |"
        for m in models:
            got = per_model.get(m)
            if got is None:
                line += " – | – | – |"
            else:
                line += (f" {got['reference']} | {cell(got['final'], got['delta'])} | "
                         f"{cell(got['tail'], got['tail_delta'])} |")
        lines.append(line + f" {goal_verdict(ef, per_model)} |")
    lines.append("")
    return lines


def convergence_note(run):
    """Whether dense's test accuracy had stopped rising: the best of the last three epochs
    against the best before them."""
    acc = [c["test_accuracy"] for c in run.get("curve", [])]
    if len(acc) < 4:
        return f"{len(acc)} epoch(s): too few to judge convergence"
    gain = max(acc[-3:]) - max(acc[:-3])
    verdict = "converged" if gain < 0.005 else "NOT converged: raise --epochs"
    return (f"best of the last 3 epochs {max(acc[-3:]):.4f} vs {max(acc[:-3]):.4f} before "
            f"({100 * gain:+.2f} pt): {verdict}")


def render_markdown(report):
    runs = report["runs"]
    dense = dense_by_model(runs)
    cfg = report["config"]
    lines = [f"# Convergence: {cfg['dataset']}, {cfg['workers']} workers, batch "
             f"{cfg['batch_size']} per worker" + (" (quick smoke run)" if cfg.get("quick") else ""),
             "",
             "`python benchmarks/convergence.py` (see benchmarks/README.md). Accuracy: the whole "
             "test set after the last epoch. `Δ dense`: points against `none` (dense, momentum "
             "SGD) on the same model. `sent/step`: bytes one worker (worker 0) sends per step, "
             "last step; `wire ratio`: the dense ring all-reduce's bytes over that; `total "
             "sent`: the whole run. `train s`: training time without the per-epoch "
             "evaluations.",
             ""]
    if not report.get("complete"):
        lines += ["**Incomplete**: the sweep was interrupted or is still running.", ""]
    header = ("| compressor | spec | model | optimizer | final acc | Δ dense (pt) | best acc | "
              "sent/step | wire ratio | total sent | median step ms | train s | epochs |")
    lines += [header, "|:--|:--|:--|:--|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in runs:
        spec = r.get("spec", r["spec_template"])
        if r.get("status") != "ok":
            lines.append(f"| {r['label']} | `{spec}` | {r['model']} | {optimizer_text(r)} | "
                         f"failed: {escape_md(r.get('reason', '?'))} |  |  |  |  |  |  |  | "
                         f"{r['epochs']} |")
            continue
        d = dense.get(r["model"])
        delta = (f"{100 * (r['final_accuracy'] - d['final_accuracy']):+.1f}"
                 if d is not None else "–")
        lines.append(
            f"| {r['label']} | `{spec}` | {r['model']} | {optimizer_text(r)} | "
            f"{r['final_accuracy']:.4f} | {delta} | {r['best_accuracy']:.4f} | "
            f"{fmt_bytes(r['sent_bytes_per_step'])} | {r['wire_ratio']:.1f}× | "
            f"{fmt_bytes(r['total_sent_bytes'])} | {r['median_step_ms']:.1f} | "
            f"{r['train_seconds']:.0f} | {len(r['curve'])} |")
    lines.append("")
    for model, d in dense.items():
        lines.append(f"- dense on {model}: {convergence_note(d)}")
    odd = [r for r in runs if r.get("status") == "ok" and r.get("reductions")
           != r["epochs"] * r["steps_per_epoch"]]
    for r in odd:
        lines.append(f"- {r['model']} {r['label']}: {r['reductions']} reductions recorded for "
                     f"{r['epochs']} x {r['steps_per_epoch']} steps")
    busy = [r for r in runs if r.get("status") == "ok"
            and r.get("load_before", 0) - r["workers"] > (report.get("cpu_count") or 1) / 2]
    if busy:
        lines.append(f"- {len(busy)} run(s) started on a busy machine (1-minute load above "
                     "workers + cores/2): their step and train times say as much about the "
                     "other load as about the compressor")
    for n in report.get("notes", []):
        lines.append(f"- {n}")
    lines.append("")
    lines += render_goal_table(report)
    lines.append("Settings (spec, optimizer, why):")
    lines.append("")
    for e in report["settings"]:
        lines.append(f"- **{e['label']}** `{e['spec']}`, {e['optimizer']} lr {e['lr']:g}: "
                     f"{e['source']}")
    lines.append("")
    return "\n".join(lines)


def escape_md(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_curves_csv(path, runs):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "compressor", "spec", "epoch", "test_accuracy",
                    "cumulative_sent_bytes", "train_seconds"])
        for r in runs:
            if r.get("status") != "ok":
                continue
            for c in r["curve"]:
                w.writerow([r["model"], r["label"], r["spec"], c["epoch"],
                            f"{c['test_accuracy']:.4f}", c["cumulative_sent_bytes"],
                            f"{c['train_seconds']:.2f}"])


def plot_series(runs, model, xkey):
    """[(label, [(x, accuracy), ...])] for one model; log-x plots drop x <= 0."""
    out = []
    for r in runs:
        if r.get("status") != "ok" or r["model"] != model:
            continue
        pts = [(c[xkey], c["test_accuracy"]) for c in r["curve"]
               if not math.isnan(c["test_accuracy"]) and (xkey != "cumulative_sent_bytes"
                                                        or c[xkey] > 0)]
        if pts:
            out.append((r["label"], pts))
    return out


PLOTS = (("bytes", "cumulative_sent_bytes", "bytes sent per worker (cumulative, log scale)",
          "bytes sent", True),
         ("time", "train_seconds", "training time, s (evaluations left out)", "training time",
          False))


def write_plots(report, prefix):
    """Per model: accuracy vs cumulative bytes (log x) and vs wall time. Returns the paths."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    cfg = report["config"]
    paths = []
    for model in cfg["models"]:
        for suffix, xkey, xlabel, what, xlog in PLOTS:
            series = plot_series(report["runs"], model, xkey)
            if not series:
                continue
            title = (f"{model} on {cfg['dataset']}, {cfg['workers']} workers: "
                     f"test accuracy vs {what}")
            if plt is not None:
                path = f"{prefix}_{model}_{suffix}.png"
                fig, ax = plt.subplots(figsize=(10, 6))
                cmap = plt.get_cmap("tab20")
                for i, (label, pts) in enumerate(series):
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o", markersize=3, color=cmap(i % 20),
                            linestyle="-" if i < 20 else "--", label=label)
                if xlog:
                    ax.set_xscale("log")
                ax.set_xlabel(xlabel)
                ax.set_ylabel("test accuracy")
                ax.set_title(title)
                ax.grid(True, alpha=0.3)
                ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
                fig.tight_layout()
                fig.savefig(path, dpi=110)
                plt.close(fig)
            else:
                path = f"{prefix}_{model}_{suffix}.svg"
                with open(path, "w") as f:
                    f.write(svg_plot(title, xlabel, "test accuracy", series, xlog))
            paths.append(path)
    return paths





def write_outputs(report, args, quiet):
    md = render_markdown(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    _common.write_json(args.out + ".json", report)
    write_curves_csv(args.out + "_curves.csv", report["runs"])
    if quiet:
        return
    plots = write_plots(report, args.out)
    print()
    print(md)
    print(f"wrote {args.out}.md, {args.out}.json, {args.out}_curves.csv"
          + (", " + ", ".join(plots) if plots else ""))
    if plots and plots[0].endswith(".svg"):
        print("(matplotlib is not installed: the plots are SVG written by the script; the "
              "data behind them is in the CSV)")


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
