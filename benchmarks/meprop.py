"""meProp: backward-pass time of tfgc.keras.MePropDense against keras Dense.

    python benchmarks/meprop.py                       # speed table, B=32, widths 500 and 2048
    python benchmarks/meprop.py --widths 500 --repeats 3
    python benchmarks/meprop.py --accuracy            # Fashion-MNIST MLP, meProp k=80 vs dense

Speed. One hidden layer of an MLP, as in the paper (n = m = 500, and a wider 2048),
is timed on its own in this process (no cluster): the input ``x`` (B x n) and an
upstream gradient ``G`` (B x m) are fixed, and the loss is ``sum(layer(x) * G)``, so
the backward pass is exactly the layer's (dx, dW and db). Two ``tf.function``s are
timed for every layer: the forward pass alone, and forward plus
``tf.GradientTape.gradient`` with respect to x, the kernel and the bias. Each runs
a block of ``--steps`` steps in one in-graph loop (one step at a time, so the
Python call overhead is paid once per block), after a warm-up that traces and
compiles. Backward time is (forward + backward) - forward, from two blocks timed
one after the other. A repetition times every meProp configuration once, each
right next to a Dense layer of the same shape (Dense first every other time), in
an order that rotates from one repetition to the next. The table shows median
milliseconds per step over ``--repeats`` repetitions (Dense's over all of its
blocks) and, as the speed-up, the median over repetitions of the ratio
Dense / meProp of the adjacent timings: on a shared machine, a ratio of timings
taken seconds apart is much steadier than a ratio of medians.

Accuracy (``--accuracy``). A 784-500-10 MLP (ReLU hidden layer, meProp on the
hidden layer only: the 10-unit output layer cannot keep k = 80) is trained on
Fashion-MNIST with Adam in one process, once with Dense and once with MePropDense
(unified by default; ``--modes unified,per_example`` adds the other mode) per seed,
from the same initial weights and the same batch order, and the test accuracy of
each is printed, with the wall time of ``model.fit`` (which includes the input
pipeline and the optimizer, so it shows much less of the backward-pass gain than
the speed table).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)

DEFAULT_OUT = os.path.join(_common.RESULTS_DIR, "meprop.json")
DEFAULT_ACCURACY_OUT = os.path.join(_common.RESULTS_DIR, "meprop_accuracy.json")
REFERENCE_WIDTH = 500  # --steps is the block length at this width


def int_list(text):
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", type=int_list, default=[500, 2048],
                   help="layer widths n = m, comma-separated (default 500,2048)")
    p.add_argument("--batch_sizes", type=int_list, default=[32],
                   help="batch sizes B, comma-separated (default 32)")
    p.add_argument("--ks", type=int_list, default=[10, 20, 80],
                   help="k values below the width, comma-separated; k = m is always added "
                        "(default 10,20,80)")
    p.add_argument("--modes", default=None,
                   help="meProp modes, comma-separated (default: unified,per_example for "
                        "the speed table, unified for --accuracy)")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions (default 7)")
    p.add_argument("--steps", type=int, default=50,
                   help="steps per timed block at width 500 (default 50); wider layers use "
                        "proportionally fewer (by n*m), at least 10")
    p.add_argument("--warmup", type=int, default=2, help="untimed blocks first (default 2)")
    p.add_argument("--threads", type=int, default=0,
                   help="intra/inter-op threads; 0 (default): TensorFlow's default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help=f"JSON output (default {DEFAULT_OUT}, or {DEFAULT_ACCURACY_OUT} "
                        "with --accuracy)")
    acc = p.add_argument_group("accuracy (--accuracy)")
    acc.add_argument("--accuracy", action="store_true",
                     help="train the Fashion-MNIST MLP instead of timing layers")
    acc.add_argument("--k", type=int, default=80, help="meProp k of the hidden layer (default 80)")
    acc.add_argument("--hidden", type=int, default=500, help="hidden units (default 500)")
    acc.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    acc.add_argument("--batch_size", type=int, default=64, help="batch size (default 64)")
    acc.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    acc.add_argument("--seeds", type=int, default=3,
                     help="seeds, each trains every model once (default 3)")
    acc.add_argument("--dataset", default="fashion_mnist",
                     help="tfgc.apps.data dataset name (default fashion_mnist)")
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = "unified" if args.accuracy else "unified,per_example"
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in ("unified", "per_example")]
    if bad:
        p.error(f"unknown --modes {bad}; valid: unified, per_example")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.seeds < 1:
        p.error("--repeats, --steps and --seeds must be >= 1, --warmup >= 0")
    if args.out is None:
        args.out = DEFAULT_ACCURACY_OUT if args.accuracy else DEFAULT_OUT
    return args


def setup_tf(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    tf.get_logger().setLevel("ERROR")
    return tf


def machine_info():
    import tensorflow as tf
    return {"cpu_count": os.cpu_count(), "tensorflow": tf.__version__,
            "gpus": len(tf.config.list_physical_devices("GPU"))}


# ---------------------------------------------------------------------- speed


def make_layer(kind, width, k, mode, kernel, bias):
    import tf_keras as keras
    from tfgc.keras import MePropDense

    if kind == "dense":
        layer = keras.layers.Dense(width)
    else:
        layer = MePropDense(width, k, mode=mode)
    layer.build((None, kernel.shape[0]))
    layer.set_weights([kernel, bias])
    return layer


def make_timers(tf, layer, x, g, steps):
    """(forward block, forward+backward block): tf.functions running ``steps`` steps.

    ``parallel_iterations=1`` keeps the loop from overlapping steps. Both blocks
    compute the same loss; in the second, one row of every gradient joins the running
    sum as well, so that nothing is pruned as unused while the sum itself costs
    next to nothing.
    """
    def run(body):
        def loop():
            return tf.while_loop(lambda i, acc: i < steps, body,
                                 (tf.constant(0), tf.constant(0.0, x.dtype)),
                                 parallel_iterations=1)[1]
        return tf.function(loop, autograph=False)

    def forward(i, acc):
        return i + 1, acc + tf.reduce_sum(layer(x) * g)

    def forward_backward(i, acc):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) * g)
        dx, dw, db = tape.gradient(loss, [x, layer.kernel, layer.bias])
        return i + 1, acc + loss + tf.reduce_sum(dx[:1]) + tf.reduce_sum(dw[:1]) + db[0]

    return run(forward), run(forward_backward)


def time_block(fn):
    start = time.perf_counter()
    fn().numpy()
    return time.perf_counter() - start


def speed_main(args):
    tf = setup_tf(args)
    import numpy as np

    configs = []  # dicts, with their timers attached while measuring
    for batch in args.batch_sizes:
        for width in args.widths:
            rng = np.random.default_rng(args.seed)
            kernel = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
            bias = (0.1 * rng.standard_normal(width)).astype(np.float32)
            x = tf.constant(rng.standard_normal((batch, width)).astype(np.float32))
            g = tf.constant(rng.standard_normal((batch, width)).astype(np.float32))
            steps = max(10, round(args.steps * REFERENCE_WIDTH ** 2 / width ** 2))
            ks = sorted({k for k in args.ks if 1 <= k < width} | {width})
            variants = [("dense", None, None)]
            variants += [("meprop", mode, k) for mode in args.modes for k in ks]
            for kind, mode, k in variants:
                layer = make_layer(kind, width, k, mode, kernel, bias)
                fwd, fb = make_timers(tf, layer, x, g, steps)
                configs.append({"batch": batch, "width": width, "kind": kind, "mode": mode,
                                "k": k, "steps": steps, "fwd_s": [], "fb_s": [], "pairs_s": [],
                                "_timers": (fwd, fb)})

    load_before = os.getloadavg()[0]
    print(f"meProp backward time vs keras Dense: widths {args.widths}, batch {args.batch_sizes}, "
          f"modes {args.modes}, {args.repeats} repetitions after {args.warmup} warm-up blocks; "
          f"{os.cpu_count()} CPU core(s), load {load_before:.1f}", flush=True)
    started = time.monotonic()
    for c in configs:  # warm-up: tracing, XLA compilation, allocator
        for _ in range(args.warmup):
            for fn in c["_timers"]:
                time_block(fn)
    print(f"warm-up done in {time.monotonic() - started:.0f} s", flush=True)

    def measure(c):
        fwd, fb = c["_timers"]
        f, b = time_block(fwd), time_block(fb)
        c["fwd_s"].append(f)
        c["fb_s"].append(b)
        return f, b

    dense_of = {(c["batch"], c["width"]): c for c in configs if c["kind"] == "dense"}
    others = [c for c in configs if c["kind"] != "dense"]
    for r in range(args.repeats):
        shift = r % len(others)
        for i, c in enumerate(others[shift:] + others[:shift]):
            d = dense_of[(c["batch"], c["width"])]
            # Each layer is timed right next to Dense, which goes first every other time.
            if (r + i) % 2 == 0:
                pair = measure(d) + measure(c)
            else:
                pair = measure(c)
                pair = measure(d) + pair
            c["pairs_s"].append(pair)  # (dense fwd, dense fwd+bwd, fwd, fwd+bwd)
        print(f"repetition {r + 1}/{args.repeats} done ({time.monotonic() - started:.0f} s)",
              flush=True)

    for c in configs:
        del c["_timers"]
        ms = lambda v: 1e3 * v / c["steps"]  # noqa: E731
        c["fwd_ms"] = [ms(v) for v in c.pop("fwd_s")]
        c["fb_ms"] = [ms(v) for v in c.pop("fb_s")]
        c["bwd_ms"] = [b - a for a, b in zip(c["fwd_ms"], c["fb_ms"])]
        for key in ("fwd", "fb", "bwd"):
            c[f"median_{key}_ms"] = _common.median(c[f"{key}_ms"])
        pairs = [[ms(v) for v in p] for p in c.pop("pairs_s")]
        c["pairs_ms"] = pairs
        if c["kind"] == "dense":
            c["bwd_speedup"] = c["fb_speedup"] = 1.0
            continue
        # Speed-ups are medians of the per-repetition ratios of adjacent timings.
        c["bwd_speedup"] = _common.median([(db - df) / (b - f) for df, db, f, b in pairs
                                           if b - f > 0 and db - df > 0])
        c["fb_speedup"] = _common.median([db / b for _, db, _, b in pairs])

    print_table(configs)
    load_after = os.getloadavg()[0]
    print(f"\nload average {load_before:.1f} before, {load_after:.1f} after, on "
          f"{os.cpu_count()} core(s); total {time.monotonic() - started:.0f} s")
    # This process alone accounts for a load of about 1; more than half the cores'
    # worth on top of that means other work shared the CPU with the timings.
    busy = max(load_before, load_after) - 1 > (os.cpu_count() or 1) / 2
    if busy:
        print("WARNING: the machine was busy with other work; the medians are noisy (rows "
              "that do the same work, e.g. Dense and meProp k = m, show how noisy)")
    report = {"benchmark": "meprop_speed", "config": {k: getattr(args, k) for k in (
        "widths", "batch_sizes", "ks", "modes", "repeats", "steps", "warmup", "threads", "seed")},
        "machine": machine_info(), "load_before": load_before, "load_after": load_after,
        "busy": busy, "results": configs}
    _common.write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


def print_table(configs):
    print()
    print("| B | n = m | layer | k | fwd ms | fwd+bwd ms | bwd ms | bwd speed-up | "
          "fwd+bwd speed-up |")
    print("|--:|------:|:------|--:|-------:|-----------:|-------:|-------------:|"
          "-----------------:|")
    for c in configs:
        name = "Dense" if c["kind"] == "dense" else f"meProp {c['mode']}"
        k = "-" if c["k"] is None else str(c["k"])
        print(f"| {c['batch']} | {c['width']} | {name} | {k} | {c['median_fwd_ms']:.3f} | "
              f"{c['median_fb_ms']:.3f} | {c['median_bwd_ms']:.3f} | "
              f"{c['bwd_speedup']:.2f}x | {c['fb_speedup']:.2f}x |")


# ------------------------------------------------------------------- accuracy


def build_mlp(keras, input_shape, hidden, num_classes, kind, k, mode):
    from tfgc.keras import MePropDense

    if kind == "dense":
        hidden_layer = keras.layers.Dense(hidden, activation="relu", name="hidden")
    else:
        hidden_layer = MePropDense(hidden, k, mode=mode, activation="relu", name="hidden")
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Flatten(),
        hidden_layer,
        keras.layers.Dense(num_classes, name="logits"),
    ])


def accuracy_main(args):
    tf = setup_tf(args)
    import numpy as np
    import tf_keras as keras
    from tfgc.apps import data as data_lib

    ds = data_lib.load_dataset(args.dataset, seed=args.seed)
    print(f"accuracy: {ds.name} ({len(ds.x_train)} train, {len(ds.x_test)} test), "
          f"MLP {int(np.prod(ds.input_shape))}-{args.hidden}-{ds.num_classes}, Adam lr {args.lr}, "
          f"batch {args.batch_size}, {args.epochs} epoch(s), {args.seeds} seed(s); "
          f"meProp k={args.k} on the hidden layer", flush=True)
    variants = [("dense", None)] + [("meprop", mode) for mode in args.modes]
    runs = []
    started = time.monotonic()
    for s in range(args.seeds):
        seed = args.seed + s
        initial = None
        # Alternate which model trains first, so that warm-up costs fall on both.
        for kind, mode in (variants if s % 2 == 0 else variants[::-1]):
            keras.utils.set_random_seed(seed)
            model = build_mlp(keras, ds.input_shape, args.hidden, ds.num_classes, kind,
                              args.k, mode)
            # Same initial weights for every model of a seed (the layers' shapes
            # match) and the same batches.
            if initial is None:
                initial = model.get_weights()
            else:
                model.set_weights(initial)
            model.compile(optimizer=keras.optimizers.Adam(args.lr),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            train = data_lib.make_tf_dataset(ds.x_train, ds.y_train, args.batch_size,
                                             seed=seed, drop_remainder=False)
            t0 = time.perf_counter()
            history = model.fit(train, epochs=args.epochs, verbose=0)
            fit_s = time.perf_counter() - t0
            _, test_acc = model.evaluate(ds.x_test, ds.y_test, batch_size=1024, verbose=0)
            name = "Dense" if kind == "dense" else f"meProp {mode} k={args.k}"
            runs.append({"seed": seed, "kind": kind, "mode": mode, "name": name,
                         "test_accuracy": float(test_acc),
                         "final_train_loss": float(history.history["loss"][-1]),
                         "final_train_accuracy": float(history.history["accuracy"][-1]),
                         "fit_seconds": fit_s})
            print(f"seed {seed}  {name:28s} test accuracy {100 * test_acc:6.2f}%  "
                  f"train loss {history.history['loss'][-1]:.4f}  fit {fit_s:5.1f} s",
                  flush=True)

    print()
    print("| model | test accuracy, mean (%) | per seed (%) | fit s, median |")
    print("|:------|------------------------:|:-------------|--------------:|")
    summary = []
    for kind, mode in variants:
        mine = [r for r in runs if r["kind"] == kind and r["mode"] == mode]
        accs = [100 * r["test_accuracy"] for r in mine]
        fit = _common.median([r["fit_seconds"] for r in mine])
        summary.append({"name": mine[0]["name"], "mean_test_accuracy": float(np.mean(accs)),
                        "test_accuracies": accs, "median_fit_seconds": fit})
        print(f"| {mine[0]['name']} | {np.mean(accs):.2f} | "
              f"{', '.join(f'{a:.2f}' for a in accs)} | {fit:.1f} |")
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    report = {"benchmark": "meprop_accuracy", "dataset": ds.name,
              "config": {k: getattr(args, k) for k in (
                  "k", "hidden", "epochs", "batch_size", "lr", "seeds", "seed", "modes",
                  "threads")},
              "machine": machine_info(), "runs": runs, "summary": summary}
    _common.write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


def main(argv=None):
    args = parse_args(argv)
    return accuracy_main(args) if args.accuracy else speed_main(args)


if __name__ == "__main__":
    sys.exit(main())
