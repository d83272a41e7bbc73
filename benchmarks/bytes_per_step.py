"""Bytes per step: what each compressor actually sends, measured on a real cluster.

    python benchmarks/bytes_per_step.py
    python benchmarks/bytes_per_step.py --models mlp --workers 2 4 --compressors none topk:ratio=0.001

For each model and each cluster size (default 2, 3 and 4 workers) one local cluster
is started. Inside it a single
CompressedMultiWorkerMirroredStrategy is reused for every compressor (as
tests/cluster/fit_sweep.py does): the compressor is switched, a fresh model is
built and trained for a few steps, and ``strategy.compression_stats()`` is read.
Accuracy is irrelevant here; only the byte counts of the gradient reduction are.

Three figures per worker and step: the payload it encodes, what it sends over its
link (TensorFlow's CPU collectives are rings: an all-reduce of B bytes sends
2(N-1)/N * B, an all-gather of P bytes sends (N-1) * P), and what the stock dense
ring all-reduce would send for the same gradients. Next to each measured figure the
script prints the one predicted by the wire format of each compressor, computed
here in plain Python from the model's variable shapes (see ``expected_tensor_bytes``),
so a reader can check the two agree.
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
from tfgc.apps.plots import fmt_bytes  # noqa: E402  (stdlib only)


def exact(b):
    """A byte count in full, for the tables (whose header names the unit)."""
    return fmt_bytes(b, exact=True)

DEFAULT_OUT = os.path.join(_common.RESULTS_DIR, "bytes_per_step.json")
DEFAULT_COMPRESSORS = [
    "none", "fp16", "bf16", "topk:ratio=0.01", "ef+topk:ratio=0.01", "randomk:ratio=0.01",
    "onebit", "signsgd", "efsignsgd", "qsgd", "qsgd:levels=7,bucket_size=128", "terngrad",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressors", nargs="+", default=DEFAULT_COMPRESSORS, metavar="SPEC")
    p.add_argument("--models", nargs="+", choices=["mlp", "cnn"], default=["mlp", "cnn"])
    p.add_argument("--dataset", choices=["mnist5k", "synthetic"], default="mnist5k")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="training steps per compressor")
    p.add_argument("--min_elements", type=int, default=1024,
                   help="compression policy: smaller gradients are sent dense")
    p.add_argument("--communication", default="auto",
                   choices=["auto", "allgather", "reduce_scatter", "shared_index",
                            "sparse_allreduce"],
                   help="how payloads cross the wire (auto: the reduce-scatter for signsgd, "
                        "qsgd and terngrad from 3 or 4 workers on; reduce_scatter: quantizers "
                        "only; shared_index and sparse_allreduce: top-k compressors only; the "
                        "sparse all-reduce's "
                        "bytes depend on how the workers' index sets overlap, so only its "
                        "payload has a formula)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per cluster")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--json_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or min(args.workers) < 1:
        p.error("--steps and --workers must be >= 1")
    return args


# ---------------------------------------------------------------------------------
# The wire formula, independent of the library's own byte accounting.

WORD = 4  # payloads that are all-gathered travel as int32 words
FLOAT = 4


def _words(bits_total):
    """Bytes of ``bits_total`` bits rounded up to whole 32-bit words."""
    return WORD * -(-bits_total // 32)


def _kept(n, ratio):
    # ceil(ratio * n), at least one, at most n: the sparsifiers' k.
    return min(n, max(1, int(math.ceil(ratio * n))))


def _code_bits(levels):
    # ceil(log2(2s + 1)) rounded up to a field width that divides 32.
    need = math.ceil(math.log2(2 * levels + 1))
    return next(b for b in (2, 4, 8, 16) if b >= need)


# One-line summary of each wire format, for the table.
WIRE_FORMAT = {
    "none": "32 bit/elem (all-reduce)",
    "fp16": "16 bit/elem (all-reduce)",
    "bf16": "16 bit/elem (all-reduce)",
    "randomk": "32 bit per kept value (all-reduce)",
    "topk": "64 bit per kept entry",
    "onebit": "1 bit/elem + 2 floats/column",
    "signsgd": "1 bit sign + 1 bit non-zero /elem",
    "scaledsign": "1 bit/elem + 1 float",
    "qsgd": "{bits} bit/elem + 1 float/{bucket_size}",
    "terngrad": "2 bit/elem + 1 float",
}


def _unwrap(compressor_config):
    # Error feedback only keeps a residual; what crosses the wire is the inner payload.
    if compressor_config["name"] == "ef":
        return compressor_config["config"]["compressor"]
    return compressor_config


def wire_format(compressor_config):
    cfg = _unwrap(compressor_config)
    text = WIRE_FORMAT[cfg["name"]]
    if cfg["name"] == "qsgd":
        text = text.format(bits=_code_bits(cfg["config"]["levels"]),
                           bucket_size=cfg["config"]["bucket_size"])
    return text


def expected_tensor_bytes(name, config, shape):
    """Bytes one worker sends for a compressed float32 gradient of ``shape``.

    ``name``/``config`` are the registry name and hyperparameters (error feedback
    already unwrapped: it sends exactly what its inner compressor sends). Returns
    (bytes, short description of the formula).

    Summable compressors (none, fp16, bf16, randomk) go through a plain all-reduce
    in their own dtype; the others are all-gathered with every payload tensor
    packed into whole int32 words.
    """
    n = math.prod(shape)
    cols = shape[-1]
    if name == "none":
        return 4 * n, "32 bit/elem"
    if name in ("fp16", "bf16"):
        return 2 * n, "16 bit/elem"
    if name == "randomk":
        k = _kept(n, config["ratio"])
        return 4 * k, f"k={k} x 32 bit"
    if name == "topk":
        # An explicit k overrides the ratio.
        k = min(config["k"], n) if config.get("k") else _kept(n, config["ratio"])
        return _words(32 * k) + _words(32 * k), f"k={k} x 64 bit"
    if name == "onebit":
        return _words(n) + 2 * _words(32 * cols), f"1 bit/elem + 2x{cols} floats"
    if name == "signsgd":
        return 2 * _words(n), "2 bit/elem"
    if name == "scaledsign":
        return _words(32) + _words(n), "1 bit/elem + 1 float"
    if name == "qsgd":
        bits = _code_bits(config["levels"])
        buckets = max(1, -(-n // config["bucket_size"]))
        return (_words(bits * n) + _words(32 * buckets),
                f"{bits} bit/elem + {buckets} floats")
    if name == "terngrad":
        return _words(2 * n) + _words(32), "2 bit/elem + 1 float"
    raise ValueError(f"no wire formula for compressor {name!r}")


# Control words of a checked reduction (every compressor but the stateless casts):
# the non-finite flag, the step's four digits and their squares, 9 words (float32 in
# the all-reduce, int32 in the all-gather).
CONTROL = 36
SUMMABLE = ("none", "fp16", "bf16", "randomk")
# Quantizers that can take the reduce-scatter.
RECOMPRESSIBLE = ("onebit", "signsgd", "scaledsign", "qsgd", "terngrad")


def chunk_bytes(name, config, shape, workers, second=False):
    """Payload bytes of each worker's chunk on the reduce-scatter.

    ``second``: of the owner's second-stage payload instead (it differs only for
    TernGrad, whose owner sends exact sums of N codes in ceil(log2(2N + 1)) bits,
    rounded up to a field width that divides 32, next to the shared scaler).

    A gradient is cut into one chunk per worker, dealt as evenly as possible: 1-bit
    SGD cuts row blocks of matrices with at least 512 rows per worker (or fewer
    columns than workers), whole columns otherwise,
    the others the flat tensor at whole buckets (QSGD) or elements (also when there
    are fewer buckets than workers).
    """
    n = math.prod(shape)
    if name == "onebit":
        rows, cols = n // shape[-1], shape[-1]
        # Row blocks for tall matrices (means at most 1/8 of the bits), else columns.
        axis = 0 if rows >= 512 * workers or cols < workers else 1
        view, unit = (rows, cols), 1
    else:
        view, axis, unit = (1, n), 1, config.get("bucket_size", 512) if name == "qsgd" else 1
    if view[axis] < workers:
        view, axis, unit = (n, 1), 0, 1
    size = view[axis]
    if -(-size // unit) < workers:
        unit = 1
    base, extra = divmod(-(-size // unit), workers)
    out, start = [], 0
    for r in range(workers):
        end = min(size, start + (base + (r < extra)) * unit)
        length = (end - start) * view[1 - axis]
        chunk = [view[0], end - start] if axis == 1 else [end - start, view[1]]
        if second and name == "terngrad":
            bits = next(b for b in (2, 4, 8, 16) if (1 << b) >= 2 * workers + 1)
            out.append(_words(32) + _words(bits * length))
        else:
            out.append(expected_tensor_bytes(name, config, chunk)[0])
        start = end
    return out


def expected_step(compressor_config, variables, min_elements, workers, communication="auto"):
    """Expected figures of one reduction on ``workers`` workers.

    ``variables`` are (name, shape) of the float32 trainable variables. The
    policy sends a gradient dense (32 bits/elem) if it is rank < 2 or has fewer
    than ``min_elements`` elements. Returns a dict with dense, payload and sent
    bytes, and the per-tensor rows.
    """
    cfg = _unwrap(compressor_config)
    name, config = cfg["name"], cfg["config"]
    wrapped = compressor_config["name"] == "ef"
    # Auto takes the reduce-scatter from 3 workers on (TernGrad from 4) for the
    # quantizers whose second stage needs no error feedback.
    two_stage = name in RECOMPRESSIBLE and (
        communication == "reduce_scatter"
        or (communication == "auto" and not wrapped
            and workers >= (4 if name == "terngrad" else 3)))
    dense_total = allreduce = gather = sparse = 0
    # Reduce-scatter: every chunk's payload, and the width of the padded messages.
    chunked = width = 0
    num_chunked = 0
    rows = []
    compressed = False
    for var_name, shape in variables:
        n = math.prod(shape)
        dense_total += FLOAT * n
        if len(shape) < 2 or n < max(min_elements, 1):
            payload, how = FLOAT * n, "dense"
            allreduce += payload
        else:
            compressed = True
            payload, how = expected_tensor_bytes(name, config, shape)
            if communication == "shared_index":
                # The root's k int32 indices, then every worker's k float32 values,
                # each through the plain all-reduce.
                how += ", shared index set"
                allreduce += payload
            elif communication == "sparse_allreduce":
                how += ", merged pairwise"
                sparse += payload
            elif two_stage:
                chunks = chunk_bytes(name, config, shape, workers)
                owned = chunk_bytes(name, config, shape, workers, second=not wrapped)
                how += f", {workers} chunks of up to {max(chunks)} B, twice"
                # A worker encodes every chunk but its own for their owners, and
                # the second stage of its own.
                payload = sum(chunks) - chunks[0] + owned[0]
                chunked += payload
                width += max(chunks) + max(owned)
                num_chunked += 1
            elif name in SUMMABLE:
                allreduce += payload
            else:
                gather += payload
        rows.append({"variable": var_name, "shape": list(shape), "dense_bytes": FLOAT * n,
                     "expected_payload_bytes": payload, "formula": how})
    if compressed and (wrapped or name not in ("none", "fp16", "bf16")):
        if name in SUMMABLE or communication in ("shared_index", "sparse_allreduce"):
            allreduce += CONTROL
        else:
            gather += CONTROL
    n_ = workers
    staged = 0
    if num_chunked:
        # Stage 1: N-1 messages of the padded chunks plus a rank tag; stage 2: the
        # all-gather of the owners' padded chunks plus the control words (counted
        # in ``gather`` above); TernGrad first gathers one shared scaler per tensor.
        gather -= CONTROL
        chunked += CONTROL
        staged = (n_ - 1) * (width + WORD + CONTROL)
        if name == "terngrad" and not wrapped:
            chunked += FLOAT * num_chunked
            staged += (n_ - 1) * FLOAT * num_chunked
    return {"dense": dense_total, "payload": allreduce + gather + sparse + chunked,
            "sent": None if sparse else (2 * (n_ - 1) * allreduce // n_ + (n_ - 1) * gather
                                         + staged),
            "dense_sent": 2 * (n_ - 1) * dense_total // n_, "rows": rows}


# ---------------------------------------------------------------------------------
# Worker: one cluster member; sweeps the compressors on one model.

def worker_main(args):
    import json

    import tf_keras as keras

    import tfgc
    from tfgc.apps import data as data_lib
    from tfgc.apps import models
    from tfgc.compressors import serialize, serialize_config
    from tfgc.apps.train import make_optimizer, worker_info

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        compressor=args.compressors[0], communication=args.communication,
        policy=tfgc.CompressionPolicy(min_elements=args.min_elements))
    rank, num_workers = worker_info(strategy)
    ds = data_lib.load_dataset(args.dataset, seed=0)
    x, y = data_lib.shard(ds.x_train, ds.y_train, rank, num_workers)
    train_ds = data_lib.make_tf_dataset(x, y, args.batch_size, seed=rank, repeat=True,
                                        workers=num_workers)

    results = []
    for spec in args.compressors:
        strategy.compressor = spec
        keras.utils.set_random_seed(0)
        with strategy.scope():
            # A fresh model per compressor, so its train function is traced anew
            # with the compressor just selected.
            net = models.build_model(args.model, input_shape=ds.x_train.shape[1:],
                                     num_classes=ds.num_classes, seed=0)
            net.compile(optimizer=make_optimizer("sgd", 0.01),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = strategy.compression_stats()
        t0 = time.perf_counter()
        net.fit(train_ds, epochs=1, steps_per_epoch=args.steps, verbose=0)
        seconds = time.perf_counter() - t0
        after = strategy.compression_stats()
        compressor = strategy.compressor
        results.append({
            "spec": spec,
            "compressor": serialize(compressor),
            "compressor_config": serialize_config(compressor),
            "summable": bool(compressor.summable),
            "variables": [(v.name, [int(d) for d in v.shape]) for v in net.trainable_variables],
            "variable_dtypes": sorted({v.dtype.name for v in net.trainable_variables}),
            "dense_bytes": after["dense_bytes"],
            "payload_bytes": after["payload_bytes"],
            "sent_bytes": after["sent_bytes"],
            "received_bytes": after["received_bytes"],
            "dense_sent_bytes": after["dense_sent_bytes"],
            "ratio": after["ratio"],
            "wire_ratio": after["wire_ratio"],
            # Reductions recorded during this fit; should equal --steps.
            "reductions": after["steps"] - before["steps"],
            "fit_seconds": seconds,
        })
        print(f"[bytes_per_step] {args.model} {spec}: {after['sent_bytes']} sent, "
              f"{after['payload_bytes']} payload of {after['dense_bytes']} bytes", flush=True)
    if rank == 0:
        with open(args.json_out, "w") as f:
            json.dump({"model": args.model, "workers": num_workers, "results": results}, f)


# ---------------------------------------------------------------------------------
# Driver.

def print_table(model, workers, rows):
    print(f"\n### {model}, {workers} workers (bytes per worker and step)\n")
    print("| compressor | wire format | payload | sent | expected sent | received | "
          "dense ring sent | wire ratio | match |")
    print("|:-----------|:------------|--------:|-----:|--------------:|---------:|"
          "----------------:|-----------:|:-----:|")
    for r in rows:
        print(f"| {r['spec']} | {wire_format(r['compressor_config'])} | "
              f"{exact(r['payload_bytes'])} | {exact(r['sent_bytes'])} | "
              f"{exact(r['expected']['sent'])} | {exact(r['received_bytes'])} | "
              f"{exact(r['dense_sent_bytes'])} | {r['wire_ratio']:.1f}x | "
              f"{'yes' if r['match'] else '**NO**'} |")


def print_formula(model, row):
    print(f"\nper-tensor wire formula for {model} ({row['spec']}):")
    for t in row["expected"]["rows"]:
        print(f"  {t['variable']:<24} {str(tuple(t['shape'])):<18} "
              f"{t['dense_bytes']:>9,} B dense -> {t['expected_payload_bytes']:>9,} B  "
              f"({t['formula']})")


def driver_main(args):
    scratch = _common.scratch_dir("tfgc_bytes_")
    log_path = os.path.join(scratch, "workers.log")
    print(f"bytes per step: {len(args.compressors)} compressors x {args.models} on "
          f"{args.workers} workers, {args.steps} steps each on {args.dataset}, "
          f"policy min_elements={args.min_elements}")
    print(f"worker output: {log_path}", flush=True)

    report = {"benchmark": "bytes_per_step",
              "config": {k: getattr(args, k) for k in (
                  "compressors", "models", "dataset", "workers", "batch_size", "steps",
                  "min_elements", "communication")},
              "runs": []}
    all_match = True
    started = time.monotonic()
    with open(log_path, "w") as log:
        for model in args.models:
            for workers in args.workers:
                json_path = os.path.join(scratch, f"{model}.{workers}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
                       "--json_out", json_path, "--dataset", args.dataset,
                       "--batch_size", str(args.batch_size), "--steps", str(args.steps),
                       "--min_elements", str(args.min_elements),
                       "--communication", args.communication,
                       "--compressors", *args.compressors]
                log.write(f"\n===== {model}, {workers} workers =====\n")
                t0 = time.monotonic()
                got = _common.run_cluster(cmd, workers, json_path, args.timeout, log)
                print(f"{model}, {workers} workers: cluster ran {time.monotonic() - t0:.0f} s",
                      flush=True)
                rows = []
                for r in got["results"]:
                    if r["variable_dtypes"] != ["float32"]:
                        raise RuntimeError("formula assumes float32 variables, got "
                                           f"{r['variable_dtypes']}")
                    exp = expected_step(r["compressor_config"], r["variables"],
                                        args.min_elements, workers, args.communication)
                    r["expected"] = exp
                    r["match"] = (exp["dense"] == r["dense_bytes"]
                                  and exp["payload"] == r["payload_bytes"]
                                  and exp["sent"] in (None, r["sent_bytes"])
                                  and r["sent_bytes"] == r["received_bytes"]
                                  and exp["dense_sent"] == r["dense_sent_bytes"]
                                  and r["reductions"] == args.steps)
                    all_match &= r["match"]
                    rows.append(r)
                report["runs"].append({"model": model, "workers": workers, "results": rows})

    for run in report["runs"]:
        print_table(run["model"], run["workers"], run["results"])
    # One worked example per model makes the formula concrete.
    for run in report["runs"]:
        if run["workers"] == args.workers[0]:
            example = next((r for r in run["results"] if r["spec"] == "onebit"),
                           run["results"][0])
            print_formula(run["model"], example)

    report["all_match"] = all_match
    print(f"\nmeasured == expected for every row: {'yes' if all_match else 'NO'}"
          f"  (total {time.monotonic() - started:.0f} s)")
    _common.write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0 if all_match else 1


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
