"""Network: step time and bytes on the wire over bandwidth-limited links (needs root).

    sudo python benchmarks/network.py                       # the default sweep (see below)
    sudo python benchmarks/network.py --workers 2 --rates 100mbit --configs none@auto --steps 10
    sudo python benchmarks/network.py --models wide_mlp cnn --rates 100mbit 10gbit \\
        --configs "qsgd:levels=7,bucket_size=128@allgather" "ef+topk:ratio=0.01@auto"
    sudo python benchmarks/network.py --models gan --workers 2 --rates 1gbit --configs auto \
        --auto_plan settled --auto_pins own bf16 rqsgd4 psgd2 topk1 --bytes_workers

The benchmark builds a small shaped cluster on this one machine, as root: one network
namespace per worker (``tfgcb<pid>-w<i>``), each joined by a veth pair to a bridge that
lives in a separate "switch" namespace (``tfgcb<pid>-sw``), and
``tc qdisc ... tbf rate R burst 64kb latency 50ms`` on BOTH ends of every link (the
worker's ``eth0`` and its peer on the bridge), so every byte a worker sends or receives
crosses a link of rate R. Workers get the private addresses 10.77.0.<i+1>/24, which
exist only inside these namespaces; nothing in the host's own namespace is touched.

Each run starts one cluster (a process per worker, started with ``ip netns exec`` and a
TF_CONFIG naming the namespaces' addresses; ``tfgc.apps.launch`` cannot place workers in
different namespaces, so this script starts them itself) and trains for ``--warmup`` +
``--steps`` batches. A Keras callback times every batch; the median of the timed steps
is the step time. The same callback reads the worker's veth counters
(``/sys/class/net/eth0/statistics/tx_bytes``, inside its namespace) before the first
and after the last timed step: the bytes each worker really sent per step, TCP/IP and
gRPC framing included, next to the strategy's own ``sent_bytes`` accounting.

Every configuration is compared with the stock ``tf.distribute.MultiWorkerMirroredStrategy``
at the same (model, rate, workers), run in the same sweep. Configurations are
``SPEC@COMMUNICATION`` (compressor spec and the strategy's ``communication``
argument). A configuration that fails (for example a ``communication`` this version of
tfgc does not know) is recorded as "failed: <reason>" and the sweep goes on; one
whose strategy cannot even be constructed is not started again.

Default sweep (the issue's goal set): the wide MLP 784-2048-2048-10 (5.8M parameters)
on 4 workers at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s; stock, qsgd 4-bit and onebit over
both allgather and reduce_scatter, ef+topk 0.1 % and 1 %; plus a bytes-vs-N sweep at
10 Gbit/s with 2, 4 and 8 workers and a few steps. Outputs: a Markdown table on stdout
and in ``benchmarks/results/network.md``, raw figures in ``network.json``, and a plot
``network.svg`` (written by hand: no plotting dependency).

Clean-up: namespaces (and with them the veths and the bridge) are deleted on every exit
path: normal end, exception, SIGINT/SIGTERM/SIGHUP (try/finally plus signal handlers).
At start, namespaces left by an earlier run of this script that was killed outright
(prefix ``tfgcb``, owner process gone) are removed. Each run is bounded by
``--timeout``; on timeout or failure the process groups of all its workers are killed.
Without root, ``ip``, ``tc`` or network-namespace support the script prints why and
exits 0 ("skipped").

The driver never imports TensorFlow; workers are this script run again with ``--worker``.
The namespaces and links are ``netns.py``; the tables and the plot ``network_report.py``.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
from netns import (NS_PREFIX, SUBNET, TBF, WORKER_DEV, Cluster, NetError,  # noqa: E402
                   clean_leftovers, delete_namespace, list_namespaces, preflight, tool)
from network_report import (STOCK, add_speedups, rate_bps, render_markdown,  # noqa: E402
                            render_svg, split_config, split_options)
from tfgc.apps.plots import fmt_bytes  # noqa: E402  (stdlib only)

DEFAULT_OUT = os.path.join(_common.RESULTS_DIR, "network")
BASE_PORT = 20000
QSGD4 = "qsgd:levels=7,bucket_size=128"
DEFAULT_CONFIGS = [
    f"{QSGD4}@allgather", f"{QSGD4}@reduce_scatter",
    "onebit@allgather", "onebit@reduce_scatter",
    "ef+topk:ratio=0.001@auto", "ef+topk:ratio=0.01@auto",
]
ARGUMENT_ERRORS = ("ValueError", "TypeError", "KeyError")
MODELS = ("wide_mlp", "cnn", "mlp", "resnet50", "mobilenetv2", "encoder", "gan", "bag")
# ResNet-50 (tf_keras.applications, no weights) on synthetic 32x32x3 images, 10 classes.
RESNET_SHAPE, RESNET_EXAMPLES = (32, 32, 3), 2048
# Models built by benchmarks/models.py, on its synthetic data: MobileNetV2, the
# BERT-like encoder whose token embedding's gradient is an IndexedSlices, and a GAN
# whose train_step applies two optimizers (two reductions a step), and a bag of
# embeddings whose table is its only gradient worth compressing.
USER_MODELS = ("mobilenetv2", "encoder", "gan", "bag")
WIDE_MLP_UNITS = (2048, 2048)
# --auto_plan settled: steps under AutoPlanCallback before the warm-up: three intervals
# of AUTO_SETTLE_EVERY steps (each a trace or retrace, a step that settles, and six the
# callback times for the plan's pace: with one, ResNet-50's step-to-step spread set
# the pace's slope), then the step that retraces for the settled plan. The third
# times the plan chosen at the second's end, so that one that runs slower than a plan
# timed before gives way to it, as it would in training.
AUTO_SETTLE_EVERY = 8
AUTO_SETTLE_STEPS = 3 * AUTO_SETTLE_EVERY + 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=MODELS, default=["wide_mlp"],
                   help="wide_mlp: 784-2048-2048-10 (defined here); cnn, mlp: "
                        "tfgc.apps.models; resnet50: tf_keras.applications on 32x32 "
                        "images; mobilenetv2, encoder, gan, bag: as benchmarks/models.py "
                        "builds them, on its synthetic data")
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"],
                   help="link rates in tc's syntax (default: 100mbit 1gbit 10gbit)")
    p.add_argument("--workers", type=int, nargs="+", default=[4],
                   help="cluster sizes of the step-time sweep (default: 4)")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="SPEC@COMM",
                   help="tfgc configurations, compressor spec @ communication ('@auto' if "
                        "left out); the stock strategy always runs too")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the step-time sweep (default 1): at each rate every "
                        "configuration runs once a round, round after round, so that the "
                        "machine's drift falls on all of them; the tables give each "
                        "setting's median over rounds, speed-ups and ratios the median of "
                        "each round's own")
    p.add_argument("--warmup", type=int, default=5,
                   help="leading steps left out (tracing, connection set-up; default 5)")
    p.add_argument("--bytes_workers", type=int, nargs="*", default=[2, 4, 8],
                   help="cluster sizes of the bytes-vs-N sweep (default: 2 4 8; none: skip it)")
    p.add_argument("--bytes_rate", default="10gbit",
                   help="link rate of the bytes-vs-N sweep (default 10gbit)")
    p.add_argument("--bytes_steps", type=int, default=3,
                   help="timed steps per bytes-sweep run (default 3, after 2 warm-up steps)")
    p.add_argument("--dataset", choices=["fashion_mnist", "synthetic"], default="fashion_mnist",
                   help="fashion_mnist (falls back to synthetic, noted in the output, when "
                        "not installed) or synthetic")
    p.add_argument("--batch_size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--learning_rate", type=float, default=0.01)
    p.add_argument("--min_elements", type=int, default=1024,
                   help="compression policy: smaller gradients are sent dense")
    p.add_argument("--threads", type=int, default=-1,
                   help="intra-op threads per worker (inter-op: at least 2); -1 (default): "
                        "cores // workers")
    p.add_argument("--auto_plan", choices=["first", "settled"], default="first",
                   help="compressor='auto': time the first plan (made at the first step, "
                        "quantizers only; default), or 'settled': the plan it keeps once "
                        "training leaves its critical regimes, low rank included "
                        f"({AUTO_SETTLE_STEPS} steps with AutoPlanCallback before the "
                        f"warm-up: intervals of {AUTO_SETTLE_EVERY} steps, every regime "
                        "ended at the second interval's end)")
    p.add_argument("--auto_pins", nargs="*", default=[], metavar="LABEL",
                   help="compressor='auto': after its own plan's timed steps, the same "
                        "cluster pins each of these candidates on every gradient in turn "
                        "(CompressedAllReduce.pin_plan: fp32, bf16, rqsgd8, qsgd8, rqsgd4, "
                        "psgd1-8, topk1; 'own': the plan the run timed), in two passes "
                        "(the second in reverse order), each --warmup + --steps steps, and "
                        "sets each measured step against the communication its plan "
                        "predicts: whether the planner's prices order the plans as they "
                        "run (default: none). They run within the auto run's --timeout: "
                        "raise it for many labels or a slow link")
    p.add_argument("--worker_log", choices=["warning", "info"], default="warning",
                   help="what each worker's log (w<i>.log in the run's scratch folder, "
                        "named at the start) holds of tfgc's absl logging: 'info' keeps "
                        "auto's plans and why it kept or changed one (default warning)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per run (one cluster); its workers are killed after that")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"output prefix: writes PREFIX.md, .json and .svg (default {DEFAULT_OUT})")
    # Worker-only arguments.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result_prefix", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.steps < 1 or args.warmup < 0 or args.bytes_steps < 1:
        p.error("--steps and --bytes_steps must be >= 1, --warmup >= 0")
    if min(args.workers) < 2 or (args.bytes_workers and min(args.bytes_workers) < 2):
        p.error("--workers and --bytes_workers need at least 2 workers (a link to shape)")
    if max(args.workers + (args.bytes_workers or [])) > 200:
        p.error(f"at most 200 workers fit in {SUBNET}.0/24 as addressed here")
    for rate in args.rates + [args.bytes_rate]:
        try:
            rate_bps(rate)
        except ValueError as exc:
            p.error(str(exc))
    for c in args.configs:
        try:
            split_config(c)
        except ValueError as exc:
            p.error(str(exc))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    pins = sorted(set(args.auto_pins) - set(PIN_LABELS) - {OWN})
    if pins:
        p.error(f"--auto_pins: {', '.join(pins)} not among {', '.join(PIN_LABELS + (OWN,))}")
    if args.auto_pins and args.warmup < 1:
        p.error("--auto_pins needs --warmup of at least 1 (a pinned plan's first step "
                "retraces)")
    if args.auto_pins and not any(split_config(c)[0] and split_config(c)[0].split(":")[0]
                                  == "auto" for c in args.configs):
        p.error("--auto_pins needs an auto configuration among --configs")
    args.rates = list(dict.fromkeys(args.rates))
    args.models = list(dict.fromkeys(args.models))
    args.workers = list(dict.fromkeys(args.workers))
    args.bytes_workers = list(dict.fromkeys(args.bytes_workers or []))
    args.configs = [c for c in dict.fromkeys(args.configs) if c != STOCK]
    return args


# ---------------------------------------------------------------------------------
# Worker: one cluster member inside its namespace.

def build_wide_mlp(keras, input_shape, num_classes, seed=0):
    """784-2048-2048-10, seeded: a model whose gradients (23 MB) dominate its step."""
    init = keras.initializers
    layers = [keras.Input(shape=tuple(input_shape), name="image"),
              keras.layers.Flatten(name="flatten")]
    for i, units in enumerate(WIDE_MLP_UNITS):
        layers.append(keras.layers.Dense(
            units, activation="relu", name=f"dense_{i}_{units}",
            kernel_initializer=init.GlorotUniform(seed=seed * 101 + i + 1)))
    layers.append(keras.layers.Dense(
        num_classes, name="logits",
        kernel_initializer=init.GlorotUniform(seed=seed * 101 + len(WIDE_MLP_UNITS) + 1)))
    return keras.Sequential(layers, name="wide_mlp")


def _read_counters(dev):
    base = f"/sys/class/net/{dev}/statistics/"
    out = {}
    for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
        with open(base + name) as f:
            out[name] = int(f.read())
    return out


def _cpu_busy_s():
    """CPU seconds all processes on the machine have used since boot (/proc/stat).

    user + nice + system only: interrupt and softirq time (where the kernel moves
    our own packets through the veths and the tbf queues) belongs to no process,
    and steal is the hypervisor's.
    """
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:4]]
    return sum(v) / os.sysconf("SC_CLK_TCK")


# --auto_pins: the candidates' labels (tfgc.distribute.planner.BY_LABEL's; the driver
# imports no TensorFlow, so they are listed here and a test checks them), and the
# planner's own plan.
PIN_LABELS = ("fp32", "bf16", "rqsgd8", "qsgd8", "rqsgd4", "psgd1", "psgd2", "psgd4",
              "psgd8", "topk1")
OWN = "own"


def worker_main(args):
    set_worker_log(args.worker_log)
    run_worker(args.result_prefix, lambda rank, prefix, phase: _worker(args, prefix, phase))


def set_worker_log(level):
    """absl's verbosity in a worker (``--worker_log``): at 'info' its log keeps tfgc's
    plan tables and the reasons auto keeps or changes a plan."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity({"warning": absl_logging.WARNING,
                                "info": absl_logging.INFO}[level])


def run_worker(result_prefix, body):
    """Runs ``body(rank, prefix, phase)`` as one worker of a shaped-link driver's cluster.

    ``phase[0]`` says what the worker is doing; on any exception the worker writes
    ``<prefix>.err.json`` (its rank, that phase and one line of reason) for the driver's
    report (``_failure_reason``) and re-raises, so the traceback still goes to the log.
    """
    rank = int(os.environ.get("TFGC_WORKER_INDEX", "0"))
    prefix = f"{result_prefix}.w{rank}"
    phase = ["import"]
    try:
        body(rank, prefix, phase)
    except BaseException as exc:  # noqa: BLE001  (reported, then re-raised)
        text = (str(exc).strip().splitlines() or [""])[0]
        reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        with open(prefix + ".err.json", "w") as f:
            json.dump({"rank": rank, "phase": phase[0], "reason": reason[:300]}, f)
        raise


def _worker(args, prefix, phase):
    t_start = time.perf_counter()
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    threads = args.threads
    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        # At least 2 inter-op threads: with one, a bucket's collective that becomes
        # ready waits behind whatever compute op holds the thread (the next bucket's
        # compression), and the link idles meanwhile.
        tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))

    import tfgc
    from tfgc.apps import data as data_lib
    from tfgc.apps import models
    from tfgc.apps.train import make_optimizer, worker_info

    phase[0] = "strategy"
    spec, comm = split_config(args.config)
    if spec is None:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        comm, options = split_options(comm)
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
            compressor=spec, communication=comm,
            policy=tfgc.CompressionPolicy(min_elements=args.min_elements), **options)
    rank, num_workers = worker_info(strategy)
    t_strategy = time.perf_counter()

    phase[0] = "data"
    dataset_note = ""
    if args.model == "resnet50":
        # Only the step's cost matters here: Gaussian images, uniform labels.
        rng = np.random.RandomState(rank)
        x = rng.randn(RESNET_EXAMPLES, *RESNET_SHAPE).astype(np.float32)
        y = rng.randint(0, 10, RESNET_EXAMPLES).astype(np.int64)
        dataset = "gaussian 32x32x3 images"
    elif args.model in USER_MODELS:
        import models as user_models  # benchmarks/models.py

        x, y = user_models.synthetic_data(args.model, rank, args.batch_size * num_workers)
        dataset = {"encoder": "uniform token ids", "bag": "Zipf-distributed token ids",
                   "gan": "gaussian noise and tanh-squashed gaussian samples"}.get(
                       args.model, "gaussian 32x32x3 images")
    else:
        try:
            ds = data_lib.load_dataset(args.dataset, seed=0)
        except data_lib.DatasetNotFoundError as exc:
            ds = data_lib.load_dataset("synthetic", synthetic_examples=16384, seed=0)
            dataset_note = f"{args.dataset} not installed, used synthetic ({exc})"
        x, y = data_lib.shard(ds.x_train, ds.y_train, rank, num_workers)
        dataset = ds.name
    train_ds = data_lib.make_tf_dataset(x, y, args.batch_size, seed=rank, repeat=True,
                                        workers=num_workers)

    phase[0] = "model"
    keras.utils.set_random_seed(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        if args.model in USER_MODELS:
            net, loss = user_models.build_model(keras, args.model)
        elif args.model == "wide_mlp":
            net = build_wide_mlp(keras, ds.x_train.shape[1:], ds.num_classes, seed=0)
        elif args.model == "resnet50":
            net = keras.applications.ResNet50(weights=None, input_shape=RESNET_SHAPE,
                                              classes=10)
        else:
            net = models.build_model(args.model, input_shape=ds.x_train.shape[1:],
                                     num_classes=ds.num_classes, seed=0)
        # Plain SGD under a compressor that applies the momentum itself (dgc, momentum=m).
        net.compile(optimizer=make_optimizer("momentum", args.learning_rate,
                                             getattr(strategy, "compressor", None)),
                    loss=loss)
    params = int(sum(np.prod(v.shape) for v in net.trainable_variables))
    dense_bytes = int(sum(np.prod(v.shape) * v.dtype.size for v in net.trainable_variables))

    has_stats = hasattr(strategy, "compression_stats")
    total = args.warmup + args.steps
    dev = WORKER_DEV

    class Probe(keras.callbacks.Callback):
        """Times each batch; reads the link counters around the timed steps."""

        def __init__(self):
            super().__init__()
            self.durations = []
            self.begin = self.end = None
            self._t = None

        def _snapshot(self):
            # The machine's busy time and this process's CPU time: the driver
            # subtracts all workers' from the machine's to see other load.
            snap = {"counters": _read_counters(dev), "time": time.perf_counter(),
                    "machine_cpu_s": _cpu_busy_s(), "own_cpu_s": time.process_time()}
            if has_stats:
                s = strategy.compression_stats()
                snap["stats"] = {k: s[k] for k in ("steps", "total_sent_bytes",
                                                    "total_payload_bytes")}
            return snap

        def on_train_batch_begin(self, batch, logs=None):
            if batch == args.warmup:
                self.begin = self._snapshot()
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.durations.append(time.perf_counter() - self._t)
            if batch == total - 1:
                self.end = self._snapshot()

    settle_s = went_back = settle_record = None
    if args.auto_plan == "settled" and getattr(getattr(strategy, "compressor", None),
                                               "plans_per_tensor", False):
        # The plan after the critical regimes: the first interval's end (every gradient
        # critical, nothing to compare with) measures the low-rank errors; at the second
        # no norm moves by 1e9, so every gradient takes the budget's plan, weighed by
        # the two plans' timed steps; at the third, that plan's own step is timed too,
        # and the plan kept is the planner's choice or one that ran faster
        # (``planner.prefer_timed``); a step more retraces for it. Worker 0 keeps
        # summing the gradients afterwards, as under the callback in training.
        phase[0] = "settle"
        began = time.perf_counter()
        callback = tfgc.keras.AutoPlanCallback(strategy, threshold=1e9, link_margin=None,
                                               every_steps=AUTO_SETTLE_EVERY)

        class Stop(keras.callbacks.Callback):
            # A fit as long as a training run's, stopped early: a new plan must pay for
            # its retrace over the rest of the fit, which a fit of AUTO_SETTLE_STEPS
            # would not leave.
            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 >= AUTO_SETTLE_STEPS:
                    self.model.stop_training = True

        net.fit(train_ds, epochs=1, steps_per_epoch=100 * AUTO_SETTLE_STEPS,
                callbacks=[callback, Stop()], verbose=0)
        settle_s = time.perf_counter() - began
        # How often the settle went back to a plan that ran faster than the planner's
        # later choice (``planner.prefer_timed``).
        auto = strategy.cross_device_ops._auto  # pylint: disable=protected-access
        went_back = auto.went_back
        # The planner's record after the settle (its figures, low-rank errors, and per
        # set of gradients its plan, regimes and timed steps: each plan's key, its
        # predicted communication, median step and error, the plans beside it, its
        # age), from which its choices can be made again offline.
        settle_record = auto.snapshot()

    phase[0] = "train"
    probe = Probe()
    t_fit = time.perf_counter()
    history = net.fit(train_ds, epochs=1, steps_per_epoch=total, callbacks=[probe],
                      verbose=0)
    fit_s = time.perf_counter() - t_fit

    timed_ms = [d * 1e3 for d in probe.durations[args.warmup:]]
    b, e = probe.begin, probe.end
    steps = len(timed_ms)
    diff = {k: e["counters"][k] - b["counters"][k] for k in b["counters"]}
    result = {
        "rank": rank, "workers": num_workers, "model": args.model, "config": args.config,
        "dataset": dataset, "dataset_note": dataset_note, "params": params,
        "dense_bytes": dense_bytes, "steps": steps, "warmup": args.warmup,
        "threads": threads,
        "median_ms": float(np.median(timed_ms)),
        "mean_ms": float(np.mean(timed_ms)),
        "p10_ms": float(np.percentile(timed_ms, 10)),
        "p90_ms": float(np.percentile(timed_ms, 90)),
        "timed_window_s": e["time"] - b["time"],
        "machine_cpu_s": e["machine_cpu_s"] - b["machine_cpu_s"],
        "own_cpu_s": e["own_cpu_s"] - b["own_cpu_s"],
        "warmup_ms": [d * 1e3 for d in probe.durations[:args.warmup]],
        "durations_ms": timed_ms,
        "veth": {k: v / steps for k, v in diff.items()},
        "startup_s": t_strategy - t_start, "fit_s": fit_s, "auto_settle_s": settle_s,
        "auto_went_back": went_back, "auto_record": settle_record,
        "final_loss": float(history.history["loss"][-1]),
    }
    # What the strategy itself says this worker sends per step.
    ring = 2 * (num_workers - 1) * dense_bytes // num_workers
    if has_stats:
        s = strategy.compression_stats()
        reductions = e["stats"]["steps"] - b["stats"]["steps"]
        result["strategy_sent_per_step"] = (
            (e["stats"]["total_sent_bytes"] - b["stats"]["total_sent_bytes"]) / reductions
            if reductions else float("nan"))
        result["strategy_reductions"] = reductions
        result["compression_stats"] = s
        result["dense_sent_per_step"] = s["dense_sent_bytes"]
        result["strategy_sent_source"] = "compression_stats"
    else:
        # The stock strategy keeps no account; its ring all-reduce sends 2(N-1)/N.
        result["strategy_sent_per_step"] = ring
        result["dense_sent_per_step"] = ring
        result["strategy_sent_source"] = "ring formula 2(N-1)/N x gradient bytes"
    plans = strategy.compression_plans() if hasattr(strategy, "compression_plans") else []
    if plans:
        # compressor="auto": what it chose for each gradient (of every set of gradients
        # the step reduces: a GAN's two), and from what figures (shared); the pace of
        # the set reduced last.
        plan = strategy.compression_plan()
        result["plan"] = [entry for p in plans for entry in p.key()[len("auto:"):].split(";")]
        result["plan_sets"] = len(plans)
        result["plan_figures"] = plan.figures.describe()
        if plan.pace is not None:
            result["plan_pace"] = [plan.pace.compute_s, plan.pace.scale,
                                   plan.pace.low_rank_steps, plan.pace.shared_compute_s]
    with open(prefix + ".json", "w") as f:
        json.dump(result, f)
    if plans and args.auto_pins:
        # After the run's own result is written; each pinned fit's row is added as it
        # ends, and one that fails (a label this model cannot run) is recorded, so what
        # ran is kept. (A run past --timeout is killed, and fails as a whole.)
        phase[0] = "pins"
        result["pins"] = []
        try:
            _pinned_steps(strategy, net, train_ds, args, keras, result["pins"],
                          lambda: _common.write_json(prefix + ".json", result))
        except Exception as exc:  # noqa: BLE001  (recorded; the run's own figures stand)
            text = (str(exc).strip().splitlines() or [""])[0]
            result["pins_failed"] = f"{type(exc).__name__}: {text}"[:300]
        _common.write_json(prefix + ".json", result)


def _pinned_steps(strategy, net, train_ds, args, keras, rows, save):
    """``--auto_pins``: each label pinned on every gradient in turn (``own``: the plan
    the run timed, pinned by name), in two passes, the second reversed, so that the
    machine's drift falls on both ends; a fit of ``--warmup`` + ``--steps`` steps each
    (the first step retraces where the plan changed). Adds to ``rows`` a row per fit,
    and calls ``save()`` after each: the label, the pass, the timed steps' median and
    the communication its plans predict (``Plan.step_seconds``, summed over the step's
    sets of gradients), the share of its low-rank budget each set's plan uses and the
    most steps that adds by the planner's prior (``Auto.low_rank_steps``), with the
    plans' labels counted. The planner's choice is given back at the end."""
    import numpy as np

    cdo = strategy.cross_device_ops
    labels = list(args.auto_pins)
    # The plan the run timed, by gradient name (every set's), for ``own``: given back
    # to the planner instead, it could plan afresh.
    own_plan = {e.name: e.label for plan in strategy.compression_plans()
                for e in plan.entries}
    durations = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            durations.append(time.perf_counter() - self.t)

    for pass_, order in enumerate((labels, labels[::-1])):
        for label in order:
            cdo.pin_plan(own_plan if label == OWN else label)
            durations.clear()
            net.fit(train_ds, epochs=1, steps_per_epoch=args.warmup + args.steps,
                    callbacks=[Timer()], verbose=0)
            plans = strategy.compression_plans()
            counts = {}
            for plan in plans:
                for e in plan.entries:
                    counts[e.label] = counts.get(e.label, 0) + 1
            timed = [d * 1e3 for d in durations[args.warmup:]]
            shares = [p.low_rank_share for p in plans]
            rows.append({"pin": label, "pass": pass_, "median_ms": float(np.median(timed)),
                         "durations_ms": timed,
                         "predicted_ms": 1e3 * sum(p.step_seconds() for p in plans),
                         # The share of its low-rank budget each set's plan uses, and
                         # the steps that adds by the planner's prior (of a step).
                         "low_rank_shares": shares,
                         "more_steps": strategy.compressor.low_rank_steps * max(shares),
                         "labels": counts})
            save()
    cdo.pin_plan(None)


# ---------------------------------------------------------------------------------
# The shaped cluster: namespaces, veths, a bridge, tbf.


class Interrupted(BaseException):
    """SIGINT/SIGTERM/SIGHUP: unwinds through every finally, then the driver exits."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


# ---------------------------------------------------------------------------------
# One run: start the workers in their namespaces, supervise, collect.

def worker_env(cluster, index, port):
    env = dict(os.environ)
    for k in list(env):
        # gRPC honours proxy variables; our addresses must never go through one.
        if k.lower() in ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy"):
            del env[k]
    env.update(_common.worker_env())
    addresses = [f"{a}:{port}" for a in cluster.addresses]
    env.update({
        "TF_CONFIG": json.dumps({"cluster": {"worker": addresses},
                                 "task": {"type": "worker", "index": index}}),
        "TFGC_WORKER_INDEX": str(index),
        "TFGC_NUM_WORKERS": str(cluster.n),
        "PYTHONUNBUFFERED": "1",
        "TF_USE_LEGACY_KERAS": "1",
    })
    return env


def _kill_groups(procs, grace=3.0):
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _failure_reason(run_dir, index, code, logs):
    """One line saying why worker ``index`` failed, and the phase it failed in."""
    # Oldest first: the first worker to fail usually brought the others down.
    err_files = sorted((f for f in os.listdir(run_dir) if f.endswith(".err.json")),
                       key=lambda f: os.path.getmtime(os.path.join(run_dir, f)))
    errs = []
    for name in err_files:
        try:
            with open(os.path.join(run_dir, name)) as f:
                errs.append(json.load(f))
        except (OSError, ValueError):
            pass
    mine = [e for e in errs if e.get("rank") == index] or errs
    if mine:
        return mine[0]["reason"], mine[0].get("phase")
    try:
        with open(logs[index], errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        lines = []
    named = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
    what = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
    if named:
        return f"{named[-1][:250]} ({what})", None
    return f"worker {index} {what}" + (f": {lines[-1][:200]}" if lines else ""), None


def worker_command(run, args, prefix, num_workers):
    """The command each worker of a run of ``num_workers`` starts with (``--worker``,
    writing its results under ``prefix``)."""
    threads = args.threads if args.threads >= 0 else max(1, (os.cpu_count() or 1) // num_workers)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker",
           "--model", run["model"], "--config", run["config"], "--result_prefix", prefix,
           "--dataset", args.dataset, "--batch_size", str(args.batch_size),
           "--steps", str(run["steps"]), "--warmup", str(run["warmup"]),
           "--threads", str(threads), "--min_elements", str(args.min_elements),
           "--learning_rate", str(args.learning_rate), "--auto_plan", args.auto_plan,
           "--worker_log", args.worker_log]
    if args.auto_pins and run["kind"] == "main":
        cmd += ["--auto_pins"] + list(args.auto_pins)
    return cmd


def run_once(cluster, run, args, run_dir, port):
    """Runs one configuration on ``cluster``; returns per-worker results or raises."""
    prefix = os.path.join(run_dir, "result")
    cmd = worker_command(run, args, prefix, cluster.n)
    supervise(cluster, cmd, run_dir, port, args.timeout, "--timeout")
    results = []
    for i in range(cluster.n):
        path = f"{prefix}.w{i}.json"
        if not os.path.exists(path):
            raise RunFailed(f"worker {i} exited 0 but wrote no result", None)
        with open(path) as f:
            results.append(json.load(f))
    return results


def supervise(cluster, cmd, run_dir, port, timeout, timeout_flag=""):
    """Runs ``cmd`` once per worker of ``cluster``, each in its namespace with its
    TF_CONFIG (logs ``run_dir/w<i>.log``), until all exit 0; raises RunFailed with the
    first failing worker's reason (or on timeout, after ``timeout`` seconds, named by
    the driver's ``timeout_flag``), and kills whatever is left either way."""
    os.makedirs(run_dir, exist_ok=True)
    logs = [os.path.join(run_dir, f"w{i}.log") for i in range(cluster.n)]
    procs = []
    files = []
    try:
        for i, ns in enumerate(cluster.workers):
            log = open(logs[i], "w")
            files.append(log)
            procs.append(subprocess.Popen(
                [tool("ip") or "ip", "netns", "exec", ns] + cmd,
                env=worker_env(cluster, i, port),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=_common.REPO_ROOT))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                # The first to fail with a reason of its own, else the first seen.
                time.sleep(0.5)  # let it finish writing its .err.json
                reason, phase = _failure_reason(run_dir, bad[0], codes[bad[0]], logs)
                raise RunFailed(reason, phase)
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                flag = f" ({timeout_flag})" if timeout_flag else ""
                raise RunFailed(f"timed out after {timeout:g} s{flag}; killed all workers",
                                "timeout")
            time.sleep(0.2)
    finally:
        _kill_groups(procs)
        for f in files:
            f.close()
        cluster.reap()


class RunFailed(Exception):
    def __init__(self, reason, phase):
        super().__init__(reason)
        self.reason = reason
        self.phase = phase


def summarize_run(run, workers):
    """Figures of one run from its workers' results."""
    w0 = workers[0]
    tx = [w["veth"]["tx_bytes"] for w in workers]
    rx = [w["veth"]["rx_bytes"] for w in workers]
    strat = [w["strategy_sent_per_step"] for w in workers]
    # CPU that other processes took during the timed steps, in cores: the machine's
    # busy time less what all workers used, over worker 0's timed window.
    window = w0["timed_window_s"]
    others = (w0["machine_cpu_s"] - sum(w["own_cpu_s"] for w in workers)) / window
    run.update({
        "status": "ok",
        "workers_cpu_cores": sum(w["own_cpu_s"] for w in workers) / window,
        "other_cpu_cores": max(0.0, others),
        "dataset": w0["dataset"], "dataset_note": w0["dataset_note"],
        "params": w0["params"], "dense_bytes": w0["dense_bytes"],
        "median_ms": w0["median_ms"], "p10_ms": w0["p10_ms"], "p90_ms": w0["p90_ms"],
        "median_ms_per_worker": [w["median_ms"] for w in workers],
        "veth_tx_per_step": sum(tx) / len(tx), "veth_tx_per_step_max": max(tx),
        "veth_tx_per_step_per_worker": tx,
        "veth_rx_per_step": sum(rx) / len(rx),
        "strategy_sent_per_step": sum(strat) / len(strat),
        "strategy_sent_source": w0["strategy_sent_source"],
        "dense_sent_per_step": w0["dense_sent_per_step"],
        "startup_s": max(w["startup_s"] for w in workers),
        "final_loss": w0["final_loss"],
        "threads": w0["threads"],
        "durations_ms": w0["durations_ms"],
        "warmup_ms": w0["warmup_ms"],
        "auto_settle_s": w0.get("auto_settle_s"),
        "auto_went_back": w0.get("auto_went_back"),
        "auto_record": w0.get("auto_record"),
    })
    if "pins" in w0:
        run["pins"] = w0["pins"]
        if "pins_failed" in w0:
            run["pins_failed"] = w0["pins_failed"]
    if "plan" in w0:
        run["plan"], run["plan_figures"] = w0["plan"], w0["plan_figures"]
        run["plan_sets"] = w0.get("plan_sets", 1)
        run["plan_pace"] = w0.get("plan_pace")
    if "compression_stats" in w0:
        run["compression_stats"] = w0["compression_stats"]
        run["strategy_reductions"] = w0["strategy_reductions"]


# ---------------------------------------------------------------------------------
# The sweep.

def plan_runs(args):
    """Every run, grouped by cluster size so each group shares one set of namespaces."""
    configs = [STOCK] + args.configs
    runs = []
    seen = set()
    for n in args.workers:
        for model in args.models:
            for rate in args.rates:
                for round_ in range(args.repeats):
                    for c in configs:
                        run = {"kind": "main", "model": model, "rate": rate, "workers": n,
                               "config": c, "steps": args.steps, "warmup": args.warmup}
                        if args.repeats > 1:
                            run["round"] = round_
                        runs.append(run)
                        seen.add((model, rate, n, c))
    for n in args.bytes_workers or []:
        for model in args.models:
            for c in configs:
                if (model, args.bytes_rate, n, c) in seen:
                    continue  # the main sweep already measures it
                seen.add((model, args.bytes_rate, n, c))
                runs.append({"kind": "bytes", "model": model, "rate": args.bytes_rate,
                             "workers": n, "config": c, "steps": args.bytes_steps,
                             "warmup": min(args.warmup, 2)})
    order = list(dict.fromkeys(r["workers"] for r in runs))
    runs.sort(key=lambda r: order.index(r["workers"]))  # stable within a group
    return runs


_STATE = {"cleaning": False, "pending": None, "stdout_broken": False}


def say(text=""):
    """print(), except that a closed stdout (``| head``) must not stop the sweep."""
    if _STATE["stdout_broken"]:
        return
    try:
        print(text, flush=True)
    except (BrokenPipeError, OSError, ValueError):
        _STATE["stdout_broken"] = True


def _on_signal(signum, frame):  # noqa: ARG001
    if _STATE["cleaning"]:
        _STATE["pending"] = signum  # finish cleaning up first, exit afterwards
        return
    raise Interrupted(signum)


def driver_main(args, argv, drive=None):
    """Signal handlers and the last-resort clean-up around the whole sweep, which
    ``drive(args, argv, holder)`` runs (default: this script's; time_to_accuracy.py
    passes its own). ``holder["cluster"]`` is the cluster it builds, ``holder["ready"]``
    set once namespaces may exist."""
    previous = {sig: signal.signal(sig, _on_signal)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    holder = {"cluster": None, "ready": False}
    try:
        status = (drive or _drive)(args, argv, holder)
    except Interrupted as exc:  # before the sweep started (preflight, clean-up)
        status = 128 + exc.signum
        say(f"\ninterrupted by {signal.Signals(exc.signum).name}")
    finally:
        _STATE["cleaning"] = True
        if holder["ready"]:  # past the preflight: namespaces may exist
            if holder["cluster"] is not None:
                holder["cluster"].down()
            for ns in list_namespaces():
                if ns.startswith(f"{NS_PREFIX}{os.getpid()}-"):
                    delete_namespace(ns)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if _STATE["pending"] and not status:
        status = 128 + _STATE["pending"]
    return status


def shaped_start(holder, unable, status=0):
    """The start of a sweep on shaped links (this script's, and those of the drivers
    that run under ``driver_main``): None once namespaces may be made (``holder``
    ready, an earlier run's left over removed, each said), else ``status`` after
    saying ``unable``, the reason appended, where this machine cannot make them."""
    reason = preflight()
    if reason:
        say(f"{unable}: {reason}")
        return status
    holder["ready"] = True
    removed, kept = clean_leftovers()
    if removed:
        say(f"removed {len(removed)} namespace(s) left by an earlier run: {' '.join(removed)}")
    if kept:
        say(f"note: namespaces of another running sweep left alone: {' '.join(kept)}")
    return None


def _drive(args, argv, holder):
    status = shaped_start(holder, "network benchmark skipped")
    if status is not None:
        return status

    runs = plan_runs(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    scratch = _common.scratch_dir("tfgc_network_")
    main_runs = sum(r["kind"] == "main" for r in runs)
    command = _common.command_line("network.py", argv)
    say(f"network benchmark: {len(runs)} runs ({main_runs} step-time runs: "
        f"{len(args.models)} model(s) x {len(args.rates)} rate(s) x {len(args.workers)} "
        f"cluster size(s) x {1 + len(args.configs)} configurations incl. stock"
        + (f" x {args.repeats} rounds" if args.repeats > 1 else "") + "; "
        f"{len(runs) - main_runs} more for bytes vs N at {args.bytes_rate})")
    say(f"each run: {args.warmup} warm-up + {args.steps} timed steps "
        f"({min(args.warmup, 2)} + {args.bytes_steps} in the bytes sweep), timeout "
        f"{args.timeout:g} s; worker logs under {scratch}")

    report = {
        "benchmark": "network", "command": command,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu_count": os.cpu_count(),
        "config": {k: getattr(args, k) for k in (
            "models", "rates", "workers", "configs", "steps", "repeats", "warmup",
            "bytes_workers",
            "bytes_rate", "bytes_steps", "dataset", "batch_size", "learning_rate",
            "min_elements", "threads", "timeout", "auto_plan", "auto_pins")},
        "auto_settle": {"steps": AUTO_SETTLE_STEPS, "every": AUTO_SETTLE_EVERY},
        "link": f"tbf rate R {' '.join(TBF)} on both ends of each worker's veth; bridge in "
                "a switch namespace",
        "runs": runs, "complete": False,
    }
    broken = {}  # config -> reason, for configurations whose strategy cannot be built
    started = time.monotonic()
    status = 0
    try:
        for k, run in enumerate(runs):
            cluster = holder["cluster"]
            if cluster is None or cluster.n != run["workers"]:
                if cluster is not None:
                    cluster.down()
                cluster = holder["cluster"] = Cluster(run["workers"])
                cluster.up()
            label = (f"[{k + 1:{len(str(len(runs)))}d}/{len(runs)}] {run['model']} "
                     f"N={run['workers']} {run['rate']:>7} {run['config']}"
                     + (f" (round {run['round'] + 1})" if "round" in run else ""))
            if run["config"] in broken:
                run.update(status="failed", reason=broken[run["config"]] + " (not run again)")
                say(f"{label}: failed: {run['reason']}")
                continue
            cluster.set_rate(run["rate"])
            t0 = time.monotonic()
            try:
                workers = run_once(cluster, run, args, os.path.join(scratch, f"run{k:03d}"),
                                   BASE_PORT + k % 10000)
                summarize_run(run, workers)
            except RunFailed as exc:
                run.update(status="failed", reason=exc.reason, phase=exc.phase)
                # The constructor refused its arguments: it will everywhere. (A peer
                # that died while the strategy connected is not this configuration's fault.)
                if exc.phase == "strategy" and exc.reason.split(":")[0] in ARGUMENT_ERRORS:
                    broken[run["config"]] = exc.reason
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
                # A worker result this driver cannot read: record it, keep sweeping.
                run.update(status="failed", reason=f"driver: {type(exc).__name__}: {exc}")
            run["wall_s"] = time.monotonic() - t0
            add_speedups(runs)
            done = k + 1
            eta = (time.monotonic() - started) / done * (len(runs) - done)
            if run["status"] == "ok":
                sp = run.get("speedup")
                say(f"{label}: {run['median_ms']:8.1f} ms"
                    + (f"  x{sp:.2f}" if sp else "")
                    + f"  veth {fmt_bytes(run['veth_tx_per_step'])}/step"
                    f"  (strategy {fmt_bytes(run['strategy_sent_per_step'])})"
                    f"  other load {run['other_cpu_cores']:.1f} cores"
                    f"  {run['wall_s']:.0f} s, ~{eta / 60:.0f} min left")
            else:
                say(f"{label}: failed: {run['reason']}  ({run['wall_s']:.0f} s)")
            _common.write_json(args.out + ".json", report)  # partial results survive
        report["complete"] = True
    except Interrupted as exc:
        _STATE["cleaning"] = True  # a further signal must not cut the write-up short
        status = 128 + exc.signum
        say(f"\ninterrupted by {signal.Signals(exc.signum).name}: stopping")
    except NetError as exc:
        _STATE["cleaning"] = True
        status = 1
        say(f"\nerror building the shaped cluster: {exc}")
    if holder["cluster"] is not None:
        holder["cluster"].down()
        holder["cluster"] = None

    report["wall_s"] = time.monotonic() - started
    if any(r.get("status") for r in runs):
        add_speedups(runs)
        md = render_markdown(report, args)
        with open(args.out + ".md", "w") as f:
            f.write(md)
        _common.write_json(args.out + ".json", report)
        with open(args.out + ".svg", "w") as f:
            f.write(render_svg(report, args))
        say()
        say(md)
        say(f"wrote {args.out}.md, {args.out}.json, {args.out}.svg "
            f"(total {report['wall_s'] / 60:.1f} min)")
    return status


def main(argv=None):
    return _common.main(argv, parse_args, worker_main, driver_main)


if __name__ == "__main__":
    sys.exit(main())
