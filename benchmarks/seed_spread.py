"""Seed spread of the test suite's accuracy checks: where its margins come from.

``tests/test_distributed.py`` holds every compressor of its sweep to ``dense - margin``
(2 workers, MNIST-5k, 2 epochs), a few on 3 workers with the pure-TensorFlow reference
ops. A margin read off one run breaks on the next CPU: oneDNN picks other kernels,
rounding differs, and a training run diverges from the last bit on like a run with
another seed. This driver runs the same sweep (``tests/cluster/fit_sweep.py``, the
very code the tests run) over several seeds, each seed changing the weights, the data
order, the compressors' random draws and which examples are held out, and optionally
with oneDNN off (another set of kernels, as on another CPU). It writes, per compressor,
the gap to dense of every run and the margin the tests should use:

    margin = max(mean gap + 4 * sd of the gap, worst gap + 0.02), at least 0.02

(4 standard deviations of five seeds' spread, and never tighter than the worst run
seen plus two points). Run from the repository root, in the project's venv:

    python benchmarks/seed_spread.py                          # 2 workers, seeds 0-4
    python benchmarks/seed_spread.py --workers 3 --seeds 0 1 2 3 4 --env TFGC_DISABLE_CUSTOM_OPS=1 \\
        --specs none topk:ratio=0.01 qsgd onebit powersgd
    python benchmarks/seed_spread.py --onednn both            # oneDNN on and off

Results: ``benchmarks/results/seed_spread_w<N>.json`` and ``.md`` (also printed).
"""

import argparse
import ast
import json
import math
import os
import statistics
import sys
import time

import _common
from tfgc.ops.build import cpu_model  # noqa: E402  (standard library only)

SWEEP = os.path.join(_common.REPO_ROOT, "tests", "cluster", "fit_sweep.py")


def suite_specs(name):
    """The spec list ``name`` (MAX_LOSS or MAX_LOSS3) of tests/test_distributed.py, read
    from its source (importing the test module would import TensorFlow here)."""
    path = os.path.join(_common.REPO_ROOT, "tests", "test_distributed.py")
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == name):
            return list(ast.literal_eval(node.value))
    raise KeyError(name)


def margin(gaps):
    """The margin for a list of gaps (dense minus compressor, in accuracy)."""
    mean = statistics.fmean(gaps)
    sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    return max(0.02, mean + 4 * sd, max(gaps) + 0.02)


def run_one(workers, seed, specs, extra_env, epochs, timeout, log):
    from tfgc.apps.launch import launch

    out = _common.scratch_dir("tfgc-spread-")
    command = [sys.executable, SWEEP, out, "--epochs", str(epochs), "--seed", str(seed),
               "--data-seed", str(seed), "--specs"] + specs
    result = launch(command, workers, env=_common.worker_env(extra_env), timeout=timeout,
                    output=log)
    if not result.ok:
        raise RuntimeError(f"sweep failed (seed {seed}, env {extra_env}):\n{result.message}")
    accuracies = {}
    for i, spec in enumerate(specs):
        with open(os.path.join(out, f"{i}.w0.json")) as f:
            accuracies[spec] = json.load(f)["test_accuracy"]
    return accuracies


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--specs", nargs="+", default=None,
                        help="default: the test sweep's own list for this many workers")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--onednn", choices=("on", "off", "both"), default="on")
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra environment for the workers")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None)
    parser.add_argument("--report", metavar="JSON", default=None,
                        help="only write the Markdown report of a stored result")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            stored = json.load(f)
        md_path = os.path.splitext(args.report)[0] + ".md"
        with open(md_path, "w") as f:
            f.write(render(stored))
        print(f"written to {md_path}")
        return

    specs = args.specs or suite_specs("MAX_LOSS" if args.workers == 2 else "MAX_LOSS3")
    if specs[0] != "none":
        specs = ["none"] + [s for s in specs if s != "none"]
    base_env = dict(kv.split("=", 1) for kv in args.env)
    variants = {"on": ["1"], "off": ["0"], "both": ["1", "0"]}[args.onednn]
    out_path = args.out or os.path.join(_common.RESULTS_DIR,
                                        f"seed_spread_w{args.workers}.json")
    runs = []
    log_path = os.path.join(_common.scratch_dir("tfgc-spread-log-"), "workers.log")
    with open(log_path, "w") as log:
        for onednn in variants:
            for seed in args.seeds:
                start = time.time()
                env = dict(base_env, TF_ENABLE_ONEDNN_OPTS=onednn)
                accuracies = run_one(args.workers, seed, specs, env, args.epochs,
                                     args.timeout, log)
                runs.append({"seed": seed, "onednn": onednn, "accuracy": accuracies})
                print(f"seed {seed} oneDNN {onednn}: dense {accuracies['none']:.3f} "
                      f"({time.time() - start:.0f} s)", flush=True)

    table = {}
    for spec in specs[1:]:
        gaps = [r["accuracy"]["none"] - r["accuracy"][spec] for r in runs]
        table[spec] = {"gaps": gaps, "mean_gap": statistics.fmean(gaps),
                       "sd_gap": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
                       "worst_gap": max(gaps), "margin": margin(gaps)}
    stored = {"workers": args.workers, "epochs": args.epochs, "env": base_env, "runs": runs,
              "specs": specs, "gaps": table, "cpu": cpu_model()}
    _common.write_json(out_path, stored)
    report = render(stored)
    md_path = os.path.splitext(out_path)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(report)
    print("\n" + report)
    print(f"written to {out_path} and {md_path}; worker output in {log_path}")


def render(stored):
    """The Markdown report of a stored result: the margins, then every run's accuracy."""
    runs, table = stored["runs"], stored["gaps"]
    specs = stored.get("specs") or ["none"] + sorted(table)
    seeds = sorted({r["seed"] for r in runs})
    onednn = {r["onednn"] for r in runs}
    onednn = "both" if len(onednn) > 1 else {"1": "on", "0": "off"}[onednn.pop()]
    env = " ".join(f"{k}={v}" for k, v in sorted(stored.get("env", {}).items()))
    lines = [f"# Seed spread of the suite's accuracy checks, {stored['workers']} workers",
             "",
             f"`python benchmarks/seed_spread.py --workers {stored['workers']} --seeds "
             f"{' '.join(map(str, seeds))} --onednn {onednn}"
             + (f" --env {env}" if env else "") + "`: "
             f"{len(runs)} runs of {stored['epochs']} epochs on MNIST-5k ({stored.get('cpu')}). "
             "A gap is dense minus the compressor, in accuracy; margin = max(0.02, mean + "
             "4 sd, worst + 0.02), rounded up to the next hundredth. tests/test_distributed.py "
             "uses these margins.",
             "",
             "| compressor | mean gap | sd | worst | margin |",
             "|:--|--:|--:|--:|--:|"]
    for spec in specs[1:]:
        row = table[spec]
        lines.append(f"| {spec} | {row['mean_gap']:+.3f} | {row['sd_gap']:.3f} | "
                     f"{row['worst_gap']:+.3f} | {math.ceil(row['margin'] * 100) / 100:.2f} |")
    lines += ["", "Test accuracy of every run (seed, oneDNN on or off):", "",
              "| compressor | " + " | ".join(f"s{r['seed']}/{'on' if r['onednn'] == '1' else 'off'}"
                                             for r in runs) + " |",
              "|:--|" + "--:|" * len(runs)]
    for spec in specs:
        lines.append(f"| {spec} | " + " | ".join(f"{r['accuracy'][spec]:.3f}" for r in runs)
                     + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
