"""Scaling: the cost model of each reduction path, checked on shaped clusters of 2 to 8
workers, then used for 16 to 1024 workers (needs root for the check).

    sudo python benchmarks/scaling.py                      # check (2, 3, 4, 8 workers) + predict
    sudo python benchmarks/scaling.py --workers 2 4 --rates 100mbit --sizes 65536
    python benchmarks/scaling.py --report benchmarks/results/scaling.json --alpha_us 10

**Check.** For every cluster size and link rate (``netns.Cluster``: one namespace per
worker, tbf on both ends of every link), one cluster runs: every worker

1. takes the planner's measurements (``planner.measure``: the all-reduce probe of the
   link, each candidate's encoding and decoding timed on its own CPU, all workers at
   once; the slowest worker's figures are kept), and times the codec of every setting
   that is not a candidate with the same timer (worker 0's are used), then
2. reduces one float32 gradient of each of ``--sizes`` elements through the strategy
   under every ``--configs`` setting (an auto candidate or a compressor spec, on a
   forced path), ``--repeats`` timed reductions after a warm-up, and records the
   median and the bytes the strategy counted.

The model (``tfgc.distribute.costmodel``: alpha per hop, beta per byte, the codec's
calls at their measured cost) then predicts each median twice:
with the link (alpha, beta) fitted to the **2-worker** probe at the same rate ("from
N=2": bytes and hops carried to N), and with the probe of the run itself ("same N").
The codec's CPU comes from each run's own measurements, as the planner's do.

**Predict.** With the CPU figures of the 2-worker run at the fastest rate and a link of
``--alpha_us`` per hop (default 50 us, an assumption for TCP between hosts; the hops
of this machine's gRPC on one host measure about a millisecond) at each of
``--scale_rates``, every model of ``--scale_models`` is planned by
``planner.make_plan`` at each of ``--scale_workers`` workers, and its communication per
step predicted for stock (every gradient as float32 on one ring all-reduce), each
setting on every compressed gradient (auto's candidates on their path at that N, the
others on theirs), and auto's plan.

Outputs: ``PREFIX.md`` (both tables), ``PREFIX.json`` (every figure) and ``PREFIX.svg``
(predicted communication per step against the cluster size). The driver never
imports TensorFlow; the tables are made by this script run again with ``--report``,
which also remakes them from a stored JSON, with other prediction options if given.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
import network  # noqa: E402  (worker environment, supervision, signals)
from netns import Cluster, NetError  # noqa: E402
from network_report import rate_bps  # noqa: E402
from scaling_report import ROW, gradient_shape  # noqa: E402

DEFAULT_OUT = os.path.join(_common.RESULTS_DIR, "scaling")
BASE_PORT = 23000
DEFAULT_CONFIGS = ["fp32@allreduce", "bf16@allreduce", "qsgd8@allgather",
                   "qsgd8@reduce_scatter", "rqsgd4@allgather", "rqsgd4@reduce_scatter",
                   "powersgd:rank=4@low_rank", "ef+topk:ratio=0.01@shared_index",
                   "ef+topk:ratio=0.01@allgather"]
LABELS = ("fp32", "bf16", "rqsgd8", "qsgd8", "rqsgd4")  # planner.CANDIDATES' labels
PATHS = ("allreduce", "allgather", "reduce_scatter", "low_rank", "shared_index")  # costmodel's
SCALE_MODELS = ("resnet50", "bert_base", "wide_mlp")
PREDICTION_OPTIONS = ("scale_workers", "scale_rates", "alpha_us", "call_us", "scale_models",
                      "floor_ms", "error")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3, 4, 8],
                   help="cluster sizes of the check (default 2 3 4 8; 2 must be among them)")
    p.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"],
                   help="link rates of the check, in tc's syntax")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536, 1048576],
                   help="gradient sizes in elements (default 4096 65536 1048576)")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="SETTING@PATH",
                   help=f"an auto candidate's label ({', '.join(LABELS)}) or a compressor "
                        f"spec, @ a path ({', '.join(PATHS)})")
    p.add_argument("--repeats", type=int, default=5, help="timed reductions per figure")
    p.add_argument("--threads", type=int, default=-1,
                   help="intra-op threads per worker; -1 (default): cores // workers")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per cluster")
    p.add_argument("--scale_workers", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--scale_rates", type=float, nargs="+", default=[1.0, 10.0, 100.0],
                   help="link rates of the prediction, Gbit/s")
    p.add_argument("--alpha_us", type=float, default=50.0,
                   help="seconds per hop of the prediction's links, in microseconds (default "
                        "50: TCP between hosts, an assumption; 0: the 2-worker probe's here, "
                        "which is gRPC's software on one machine)")
    p.add_argument("--call_us", type=float, default=25.0,
                   help="a codec call's fixed cost in the prediction, microseconds (default 25: "
                        "64 chunk encodes in one tf.function took 19-31 us each here); a "
                        "negative value keeps the 2-worker run's fitted intercepts (the "
                        "planner's timings: each codec's own, the timed call's cost taken "
                        "out; before 2026-11-30 they held it, up to 0.3 ms)")
    p.add_argument("--scale_models", nargs="+", choices=SCALE_MODELS, default=list(SCALE_MODELS))
    p.add_argument("--floor_ms", type=float, default=100.0,
                   help="the compute of a step, for the prediction's speed-up of the step "
                        "(default 100 ms: an assumption, the user's accelerator decides)")
    p.add_argument("--error", type=float, default=0.05, help="auto's error budget")
    p.add_argument("--out", default=DEFAULT_OUT, help="output prefix (.md, .json, .svg)")
    p.add_argument("--report", metavar="JSON", help="only make the tables from JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result_prefix", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if min(args.scale_workers) < 2 or min(args.scale_rates) <= 0 or args.alpha_us < 0 \
            or args.floor_ms < 0:
        p.error("--scale_workers >= 2, --scale_rates > 0, --alpha_us >= 0 and --floor_ms >= 0")
    if args.report:
        return args
    if 2 not in args.workers or min(args.workers) < 2 or max(args.workers) > 200:
        p.error("--workers: between 2 and 200, and 2 among them (its probe is the model's link)")
    if args.repeats < 1 or min(args.sizes) < ROW or any(s % ROW for s in args.sizes):
        p.error(f"--repeats must be >= 1 and --sizes multiples of {ROW} elements (each is a "
                f"matrix of rows of {ROW})")
    for rate in args.rates:
        try:
            rate_bps(rate)
        except ValueError as exc:
            p.error(str(exc))
    for c in args.configs:
        setting, _, path = c.rpartition("@")
        if not setting or path not in PATHS:
            p.error(f"--configs: {c!r} is not SETTING@PATH with a path of {PATHS}")
    return args


# ---------------------------------------------------------------------------------
# Worker.

def worker_main(args):
    network.run_worker(args.result_prefix,
                       lambda rank, prefix, phase: _worker(args, prefix, phase))


def _worker(args, prefix, phase):
    import numpy as np
    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, args.threads))
    import tfgc
    from tfgc.apps.train import worker_info
    from tfgc.distribute import planner

    phase[0] = "strategy"
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        compressor="none", policy=tfgc.CompressionPolicy(min_elements=1))
    rank, n = worker_info(strategy)
    cdo = strategy.cross_device_ops
    phase[0] = "measure"
    figures = planner.measure(cdo, 0.0, 0.1)
    rows, lines = [], {}
    for config in args.configs:
        label, _, path = config.rpartition("@")
        candidate = planner.BY_LABEL.get(label) or planner.Candidate(label, label)
        phase[0] = config
        if label not in planner.BY_LABEL and label not in lines:
            # Not one of auto's candidates: its codec timed here, on matrices of rows of
            # 1024 (a low-rank codec's cost needs one), with ``measure``'s timer; the
            # report takes worker 0's (``measure`` agrees on the slowest worker's).
            times = [planner._cpu_seconds(candidate, size, n, gradient_shape(size))
                     for size in planner.CPU_SIZES]
            encode = planner.fit(planner.CPU_SIZES, [t[0] for t in times])
            decode = planner.fit(planner.CPU_SIZES, [t[1] for t in times])
            lines[label] = [encode.a, encode.b, decode.a, decode.b]
        cdo.communication = "auto"
        strategy.compressor = candidate.spec or "none"
        cdo.communication = path
        for size in args.sizes:
            shape = gradient_shape(size)
            with strategy.scope():
                variables = [tf.Variable(tf.zeros(shape))]
            owner = tf.Module()

            @tf.function
            def reduce(g, variables=variables, owner=owner):
                def replica_fn(g):
                    with tfgc.compress_gradients(variables, owner=owner):
                        return tf.distribute.get_replica_context().all_reduce("sum", [g * 1.0])
                return strategy.run(replica_fn, args=(g,))

            g = tf.constant(np.random.RandomState(rank).randn(*shape).astype(np.float32))
            seconds = planner.median_seconds(
                lambda: strategy.experimental_local_results(reduce(g)[0])[0].numpy(),
                args.repeats)
            stats = strategy.compression_stats()
            rows.append({
                "label": label, "path": path, "elements": size, "seconds": seconds,
                "sent_bytes": stats["sent_bytes"], "payload_bytes": stats["payload_bytes"]})
    with open(prefix + ".json", "w") as f:
        json.dump({"rank": rank, "workers": n, "figure_words": figures.words(), "rows": rows,
                   "codec_lines": lines}, f)


# ---------------------------------------------------------------------------------
# Driver.

def drive(args, argv, holder):
    status = network.shaped_start(holder, "scaling check skipped")
    if status is not None:
        return status
    scratch = _common.scratch_dir("tfgc_scaling_")
    command = _common.command_line("scaling.py", argv)
    report = {"benchmark": "scaling", "command": command,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
              "config": {k: getattr(args, k) for k in (
                  "workers", "rates", "sizes", "configs", "repeats", "threads",
                  "scale_workers", "scale_rates", "alpha_us", "call_us", "scale_models",
                  "floor_ms", "error")},
              "runs": [], "complete": False}
    network.say(f"scaling check: {len(args.workers)} cluster sizes x {len(args.rates)} rates, "
                f"{len(args.configs)} settings x {len(args.sizes)} sizes each; logs under "
                f"{scratch}")
    started = time.monotonic()
    status = 0
    try:
        k = 0
        for n in sorted(set(args.workers)):
            cluster = holder["cluster"] = Cluster(n).up()
            for rate in args.rates:
                cluster.set_rate(rate)
                threads = (args.threads if args.threads >= 0
                           else max(1, (os.cpu_count() or 1) // n))
                run_dir = os.path.join(scratch, f"run{k:03d}")
                prefix = os.path.join(run_dir, "result")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker",
                       "--result_prefix", prefix, "--threads", str(threads),
                       "--repeats", str(args.repeats), "--sizes", *map(str, args.sizes),
                       "--configs", *args.configs]
                t0 = time.monotonic()
                run = {"workers": n, "rate": rate}
                try:
                    network.supervise(cluster, cmd, run_dir, BASE_PORT + k, args.timeout,
                                      "--timeout")
                    results = []
                    for i in range(n):
                        with open(f"{prefix}.w{i}.json") as f:
                            results.append(json.load(f))
                    run.update(status="ok", results=results)
                except network.RunFailed as exc:
                    run.update(status="failed", reason=exc.reason)
                except (OSError, ValueError) as exc:  # a result this driver cannot read
                    run.update(status="failed", reason=f"driver: {type(exc).__name__}: {exc}")
                run["wall_s"] = time.monotonic() - t0
                report["runs"].append(run)
                network.say(f"N={n} {rate:>7}: {run['status']}"
                            + (f" ({run['reason']})" if run["status"] != "ok" else "")
                            + f", {run['wall_s']:.0f} s")
                _common.write_json(args.out + ".json", report)
                k += 1
            cluster.down()
            holder["cluster"] = None
        report["complete"] = True
    except network.Interrupted as exc:
        status = 128 + exc.signum
        network.say("interrupted: stopping")
    except NetError as exc:
        status = 1
        network.say(f"error building the shaped cluster: {exc}")
    report["wall_s"] = time.monotonic() - started
    _common.write_json(args.out + ".json", report)
    if any(r["status"] == "ok" for r in report["runs"]):
        # The tables need TensorFlow (the planner): a process of their own.
        subprocess.run([sys.executable, os.path.abspath(__file__), "--report",
                        args.out + ".json", "--out", args.out], check=False,
                       env={**os.environ, **_common.worker_env()})
    return status


def main(argv=None):
    return _common.main(argv, parse_args, worker_main, _sweep_or_report)


def _sweep_or_report(args, argv):
    if args.report:
        import scaling_report
        # The prediction's options given here replace the sweep's.
        given = {k: getattr(args, k) for k in PREDICTION_OPTIONS
                 if any(a == f"--{k}" or a.startswith(f"--{k}=") for a in argv)}
        return scaling_report.main(args.report, args.out, given)
    return network.driver_main(args, argv, drive)


if __name__ == "__main__":
    sys.exit(main())
