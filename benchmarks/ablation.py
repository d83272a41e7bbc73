"""Ablation over seeds: which part of a method costs accuracy.

    python benchmarks/ablation.py --name importance \\
        --variant "dense=--compressor=none --optimizer=momentum" \\
        --variant "paper=--compressor=importance --optimizer=momentum" \\
        --variant "allgather=--compressor=importance --communication=allgather" \\
        --seeds 0 1 2 --common "--model=mlp --epochs=2"

Each variant is ``LABEL=TRAINER FLAGS``: one ``tfgc-train`` run (``python -m
tfgc.apps.train``, a local cluster of ``--workers`` workers on Fashion-MNIST) per seed,
with ``--common`` flags added to every run and ``--seed`` set per run. The first
variant is the reference: the table gives each variant's final test accuracy per seed,
their mean and standard deviation, and the mean of the per-seed differences to the
reference (the same seed shares weights and data order, so the paired difference is
less noisy than the difference of means).

Outputs: ``benchmarks/results/ablation_<name>.md`` and ``.json``; runs already in the
JSON are not run again (``--fresh`` to start over).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="names the output files")
    p.add_argument("--variant", action="append", required=True, metavar="LABEL=FLAGS",
                   help="a variant: its label and the trainer flags it runs with; the "
                        "first is the reference")
    p.add_argument("--common", default="", help="trainer flags for every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--fresh", action="store_true", help="ignore earlier results")
    args = p.parse_args(argv)
    variants = []
    for text in args.variant:
        label, eq, flags = text.partition("=")
        if not eq or not label.strip():
            p.error(f"--variant must be LABEL=FLAGS, got {text!r}")
        variants.append((label.strip(), shlex.split(flags)))
    labels = [v[0] for v in variants]
    if len(set(labels)) != len(labels):
        p.error("variant labels must differ")
    if any(s < 0 for s in args.seeds):
        p.error("--seeds must be >= 0")
    args.variants = variants
    return args


def run_one(args, flags, seed, out_dir):
    path = os.path.join(out_dir, f"run_{os.getpid()}_{time.monotonic_ns()}.json")
    cmd = [sys.executable, "-m", "tfgc.apps.train", f"--workers={args.workers}",
           f"--seed={seed}", f"--timeout={args.timeout}", f"--json_out={path}",
           *shlex.split(args.common), *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=_common.REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, **_common.worker_env()})
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or not os.path.exists(path):
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)[-400:], "seconds": seconds}
    with open(path) as f:
        result = json.load(f)
    os.remove(path)
    return {"test_accuracy": result["test_accuracy"], "seconds": seconds,
            "sent_bytes_per_step": result["sent_bytes_per_step"],
            "compressor": result["compressor_config"]}


def render(args, runs):
    ref_label = args.variants[0][0]
    lines = [f"# Ablation: {args.name}", "",
             f"`python benchmarks/ablation.py` with {args.workers} workers, seeds "
             f"{' '.join(map(str, args.seeds))}; every run: `{args.common}`. Accuracy: the "
             "whole test set after the last epoch. Δ: the mean over seeds of (variant − "
             f"`{ref_label}`) on the same seed, in points, ± its standard deviation.", "",
             "| variant | flags | " + " | ".join(f"seed {s}" for s in args.seeds)
             + " | mean | sd | Δ (pt) | sent B/step |",
             "|:--|:--|" + "--:|" * (len(args.seeds) + 4)]
    ref = runs.get(ref_label, {})
    for label, flags in args.variants:
        mine = runs.get(label, {})
        accs = [mine.get(str(s), {}).get("test_accuracy") for s in args.seeds]
        cells = [f"{a:.4f}" if a is not None else
                 ("failed" if "error" in mine.get(str(s), {}) else "–") for s, a in
                 zip(args.seeds, accs)]
        done = [a for a in accs if a is not None]
        mean = f"{statistics.mean(done):.4f}" if done else "–"
        sd = f"{statistics.stdev(done):.4f}" if len(done) > 1 else "–"
        diffs = [100 * (mine[str(s)]["test_accuracy"] - ref[str(s)]["test_accuracy"])
                 for s in args.seeds
                 if "test_accuracy" in mine.get(str(s), {})
                 and "test_accuracy" in ref.get(str(s), {})]
        delta = "–"
        if diffs:
            delta = f"{statistics.mean(diffs):+.2f}"
            if len(diffs) > 1:
                delta += f" ± {statistics.stdev(diffs):.2f}"
        sent = [mine[str(s)]["sent_bytes_per_step"] for s in args.seeds
                if "sent_bytes_per_step" in mine.get(str(s), {})]
        lines.append(f"| {label} | `{' '.join(flags)}` | " + " | ".join(cells)
                     + f" | {mean} | {sd} | {delta} | {f'{sent[0]:,}' if sent else '–'} |")
    errors = [(label, s, r["error"]) for label, seeds in runs.items()
              for s, r in seeds.items() if "error" in r]
    for label, s, err in errors:
        lines.append(f"\n- {label}, seed {s} failed: {err}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    out = os.path.join(_common.RESULTS_DIR, f"ablation_{args.name}")
    runs = {}
    if os.path.exists(out + ".json") and not args.fresh:
        with open(out + ".json") as f:
            saved = json.load(f)
        if saved.get("common") == args.common and saved.get("workers") == args.workers:
            runs = saved["runs"]
    flags_of = dict(args.variants)
    for seed in args.seeds:
        for label, flags in args.variants:
            done = runs.get(label, {}).get(str(seed))
            if done is not None and "error" not in done and done.get("flags") == flags:
                continue
            result = run_one(args, flags, seed, _common.RESULTS_DIR)
            result["flags"] = flags_of[label]
            runs.setdefault(label, {})[str(seed)] = result
            acc = result.get("test_accuracy")
            print(f"{label:<24} seed {seed}: "
                  + (f"{acc:.4f}" if acc is not None else f"failed: {result['error']}")
                  + f" ({result['seconds']:.0f} s)", flush=True)
            with open(out + ".json", "w") as f:
                json.dump({"name": args.name, "common": args.common, "workers": args.workers,
                           "seeds": args.seeds, "variants": args.variants, "runs": runs},
                          f, indent=1)
    text = render(args, runs)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
