"""What a change of plan costs: a Keras application's train function traced again.

    python benchmarks/retrace.py                                  # EfficientNetB0, 2 rounds
    python benchmarks/retrace.py --settings stock powersgd "auto:link_gbps=0.1" \
        --app MobileNetV2 --rounds 3 --retraces 5 --out /tmp/retrace

Under ``compressor="auto"`` every change of plan (``AutoPlanCallback``) makes new train
functions, as switching a compressor does: the next step traces the model's forward and
backward passes, the optimizer and tfgc's reduction again, and runs the new graph a
first time. This driver times that on a 2-worker loopback cluster per setting and round
(settings in turn, the order reversed every other round, so the machine's drift falls on
all of them): the fit's first step, ``--retraces`` forced retraces (``make_train_function
(force=True)`` and one step: trace and first run), the seconds of the trace spent in
tfgc's gradient reduction (Python building its ops), and the ordinary step. It prints
per setting the medians over rounds and retraces, and each retrace's ratio to the stock
strategy's in the same run (``stock`` among the settings). Random images and labels, 32
a worker and step: the point is the graph, not the accuracy.

The script is its own worker: the driver relaunches it with ``--worker`` under
``tfgc.apps.launch``, which sets TF_CONFIG for each process.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)

STOCK = "stock"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="+",
                   default=[STOCK, "qsgd:levels=7,bucket_size=128,norm=max,rotate=true",
                            "powersgd", "auto:link_gbps=0.1"],
                   help="'stock' (MultiWorkerMirroredStrategy) or a tfgc compressor spec")
    p.add_argument("--app", default="EfficientNetB0", help="a keras.applications model")
    p.add_argument("--rounds", type=int, default=2, help="clusters per setting (default 2)")
    p.add_argument("--retraces", type=int, default=3, help="retraces a cluster (default 3)")
    p.add_argument("--steps", type=int, default=5, help="ordinary steps timed (default 5)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per cluster")
    p.add_argument("--out", help="also write OUT.json and OUT.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--json_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.retraces < 1 or args.steps < 1:
        p.error("--rounds, --retraces and --steps must be >= 1")
    return args


# ---------------------------------------------------------------------------------
# Worker.

def worker_main(args):
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import tfgc  # pylint: disable=import-outside-toplevel
    from tfgc.distribute import cross_device_ops  # pylint: disable=import-outside-toplevel

    import tf_keras as keras  # pylint: disable=import-outside-toplevel

    if args.setting == STOCK:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor=args.setting)
    # The seconds the trace spends building tfgc's reduction: its one entry for a step's
    # gradients, timed around (the stock strategy has none: 0).
    building = [0.0]
    reduce = cross_device_ops.CompressedAllReduce._gradient_reduce

    def timed_reduce(self, *a, **kw):
        began = time.perf_counter()
        try:
            return reduce(self, *a, **kw)
        finally:
            building[0] += time.perf_counter() - began

    cross_device_ops.CompressedAllReduce._gradient_reduce = timed_reduce
    with strategy.scope():
        model = getattr(keras.applications, args.app)(weights=None, input_shape=(32, 32, 3),
                                                      classes=10)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    images = rng.normal(size=(32 * strategy.num_replicas_in_sync, 32, 32, 3)).astype("float32")
    labels = rng.integers(0, 10, size=(len(images),))
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    batches = iter(strategy.experimental_distribute_dataset(data))

    def step(function):
        began = time.perf_counter()
        function(batches)
        return time.perf_counter() - began

    first = step(model.make_train_function())
    first_building = building[0]
    steps = [step(model.train_function) for _ in range(args.steps)]
    retraces, built = [], []
    for _ in range(args.retraces):
        building[0] = 0.0
        retraces.append(step(model.make_train_function(force=True)))
        built.append(building[0])
        steps.append(step(model.train_function))  # the step after: settled
    if strategy.cluster_resolver.task_id == 0:
        with open(args.json_out, "w") as f:
            json.dump({"first_s": first, "first_building_s": first_building,
                       "retrace_s": retraces, "building_s": built,
                       "step_s": float(np.median(steps))}, f)


# ---------------------------------------------------------------------------------
# Driver.

def drive(args, argv):
    scratch = _common.scratch_dir("tfgc_retrace_")
    log_path = os.path.join(scratch, "workers.log")
    print(f"retrace: {args.app}, 2 workers on loopback, {args.rounds} round(s) of "
          f"{len(args.settings)} setting(s), {args.retraces} retraces a cluster; worker "
          f"output: {log_path}", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    began = time.monotonic()
    runs = {s: [] for s in args.settings}
    with open(log_path, "w") as log:
        for r in range(args.rounds):
            order = args.settings if r % 2 == 0 else args.settings[::-1]
            for setting in order:
                json_path = os.path.join(scratch, f"r{r}_{args.settings.index(setting)}.json")
                log.write(f"\n===== round {r}: {setting} =====\n")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--setting",
                       setting, "--json_out", json_path, "--app", args.app,
                       "--retraces", str(args.retraces), "--steps", str(args.steps)]
                got = _common.run_cluster(cmd, 2, json_path, args.timeout, log)
                runs[setting].append(got)
                print(f"round {r}: {setting}: first step {got['first_s']:.2f} s, retraces "
                      + ", ".join(f"{s:.2f}" for s in got["retrace_s"]) + " s", flush=True)
    report = {"command": _common.command_line("retrace.py", argv), "started": started,
              "cpu_count": os.cpu_count(), "wall_s": time.monotonic() - began,
              "complete": True, "app": args.app, "runs": runs,
              "summary": summarize(runs)}
    lines = render(report)
    print("\n" + "\n".join(lines))
    if args.out:
        _common.write_json(args.out + ".json", report)
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(_common.run_header(report) + [""] + lines) + "\n")
        print(f"wrote {args.out}.json and {args.out}.md")
    return 0


def summarize(runs):
    """Per setting: medians of the first step, the retraces, the reduction's building
    seconds in them and the ordinary step; the retraces' ratio to stock's."""
    summary = {}
    for setting, got in runs.items():
        summary[setting] = {
            "first_s": _common.median([g["first_s"] for g in got]),
            "retrace_s": _common.median([s for g in got for s in g["retrace_s"]]),
            "building_s": _common.median([s for g in got for s in g["building_s"]]),
            "step_s": _common.median([g["step_s"] for g in got]),
        }
    if STOCK in summary:
        for figures in summary.values():
            figures["retrace_vs_stock"] = figures["retrace_s"] / summary[STOCK]["retrace_s"]
    return summary


def render(report):
    rows = ["| setting | first step | retrace (trace and first run) | of it, tfgc's reduction "
            "built | vs stock's retrace | ordinary step |",
            "|---|--:|--:|--:|--:|--:|"]
    for setting, f in report["summary"].items():
        ratio = f.get("retrace_vs_stock")
        rows.append(f"| `{setting}` | {f['first_s']:.2f} s | {f['retrace_s']:.2f} s | "
                    f"{f['building_s']:.2f} s | "
                    + (f"{ratio:.2f}x" if ratio is not None else "-")
                    + f" | {f['step_s'] * 1e3:.0f} ms |")
    rows.append("")
    rows.append(f"{report['app']}; medians over rounds (first and ordinary steps) and over "
                "every retrace of every round; worker 0's clock.")
    return rows


if __name__ == "__main__":
    sys.exit(_common.main(None, parse_args, worker_main, drive))
