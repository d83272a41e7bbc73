"""Kernel throughput: tfgc's custom ops against their pure-TF references.

For 1M, 10M and 25M float32 elements, each op's throughput in GB/s of input
(input bytes / median time), the compiled kernel next to its reference, next to the
machine's copy bandwidth (``x * 1``: read and write, so the copy figure counts both),
pooled from a batch timed after each op. Median of ``--repeats`` runs, with the min-max
spread.

    python benchmarks/kernels.py                      # all sizes, table + JSON
    python benchmarks/kernels.py --sizes 1e6 --repeats 3

Ops whose module is not built or present yet are listed as missing, not failed.
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfgc.ops import _loader  # noqa: E402


def _module(name):
    try:
        return importlib.import_module(f"tfgc.ops.{name}")
    except ImportError:
        return None


def _samples(fn, repeats):
    """Wall times of ``repeats`` calls of ``fn()``, after one warm-up call.

    Eager CPU ops run synchronously, so the call returns when the result is ready.
    """
    fn()  # warm-up: kernel selection, allocation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _summary(times):
    return statistics.median(times), min(times), max(times)


def _time(fn, repeats):
    """Median, min and max wall time of ``fn()``."""
    return _summary(_samples(fn, repeats))


def cases(n, seed=0):
    """(name, custom fn, reference fn) triples for an input of n float32 values."""
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.standard_normal(n, dtype=np.float32))
    r = tf.constant(rng.standard_normal(n, dtype=np.float32) * 0.1)
    out = []

    sb = _module("sign_bits")
    if sb is not None:
        words = sb.pack_sign_bits(x)
        side = int(np.sqrt(n))
        m = tf.reshape(x[:side * side], [side, side])
        q = sb.onebit_quantize(m)
        out += [
            ("pack_sign_bits", lambda: sb.pack_sign_bits(x), lambda: sb.pack_sign_bits_reference(x)),
            ("unpack_sign_bits", lambda: sb.unpack_sign_bits(words, n),
             lambda: sb.unpack_sign_bits_reference(words, n)),
            ("onebit_quantize", lambda: sb.onebit_quantize(m), lambda: sb.onebit_quantize_reference(m)),
            ("onebit_dequantize", lambda: sb.onebit_dequantize(q[0], q[1], q[2], side),
             lambda: sb.onebit_dequantize_reference(q[0], q[1], q[2], side)),
        ]

    sp = _module("sparsify")
    if sp is not None:
        for ratio in (0.01, 0.001):
            k = max(1, int(ratio * n))
            out.append((f"sparsify_ef_{ratio:g}",
                        lambda k=k: sp.sparsify_with_residual(x, r, k),
                        lambda k=k: sp.sparsify_with_residual_reference(x, r, k, exact=True)))
            out.append((f"sparsify_ef_{ratio:g}_exact",
                        lambda k=k: sp.sparsify_with_residual(x, r, k, exact=True),
                        lambda k=k: sp.sparsify_with_residual_reference(x, r, k, exact=True)))
        k = max(1, n // 100)
        sel = sp.sparsify_with_residual(x, r, k, exact=True)
        vals = tf.concat([sel[0], sel[0]], 0)
        idx = tf.concat([sel[1], sel[1]], 0)
        out.append(("scatter_add_2x1%", lambda: sp.scatter_add_payloads(vals, idx, n),
                    lambda: sp.scatter_add_payloads_reference(vals, idx, n)))

    qz = _module("quantize")
    if qz is not None:
        seed_t = tf.constant([1, 2], tf.int64)
        for name, kw in (("qsgd_8bit", dict(levels=127, bucket_size=512, bits=8)),
                         ("qsgd_4bit", dict(levels=7, bucket_size=128, bits=4)),
                         ("terngrad", dict(levels=1, bucket_size=n, bits=2, norm="max"))):
            enc = qz.quantize_bucketed(x, seed_t, **kw)
            out.append((f"{name}_quantize", lambda kw=kw: qz.quantize_bucketed(x, seed_t, **kw),
                        lambda kw=kw: qz.quantize_bucketed_reference(x, seed_t, **kw)))
            dkw = {k: v for k, v in kw.items() if k != "norm"}
            out.append((f"{name}_dequantize",
                        lambda enc=enc, dkw=dkw: qz.dequantize_bucketed(enc[0], enc[1], n, **dkw),
                        lambda enc=enc, dkw=dkw: qz.dequantize_bucketed_reference(
                            enc[0], enc[1], n, **dkw)))

    th = _module("threshold")
    if th is not None:
        enc = th.threshold_encode(x, r, 2.5, -2.5)
        out += [
            ("threshold_encode", lambda: th.threshold_encode(x, r, 2.5, -2.5),
             lambda: th.threshold_encode_reference(x, r, 2.5, -2.5)),
            ("threshold_decode", lambda: th.threshold_decode(enc[0], 2.5, -2.5, n),
             lambda: th.threshold_decode_reference(enc[0], 2.5, -2.5, n)),
        ]

    # The path every sparsifier is measured against: TensorFlow's own top-k.
    def tf_topk(k):
        v = x + r
        _, idx = tf.math.top_k(tf.abs(v), k=k, sorted=False)
        return tf.gather(v, idx), idx

    out.append(("tf.math.top_k_0.01", lambda: tf_topk(max(1, n // 100)), None))
    out.append(("tf.math.top_k_0.001", lambda: tf_topk(max(1, n // 1000)), None))
    return x, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1e6, 1e7, 2.5e7])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the reference timings (they are slow at 25M)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "kernels.json"))
    args = parser.parse_args()
    if not _loader.custom_ops_available():
        print("custom op library not available: `python -m tfgc.ops.build` builds it "
              "and says why it cannot", file=sys.stderr)
        return 1

    report = {"sizes": [], "repeats": args.repeats, "cpu_count": os.cpu_count()}
    for size in args.sizes:
        n = int(size)
        x, table = cases(n)
        gb = n * 4 / 1e9
        copy_fn = lambda: x * 1.0  # noqa: E731
        # The copy is timed after every op, and the baseline is the median of all
        # those samples: on a shared machine single copy timings swing between
        # 0.6x and 1.5x of the typical one within a minute, and a baseline taken
        # once would hand that swing to every ratio of the size. Each op's own
        # repeats still run back to back, as in a training step.
        rows, copy_samples = [], []
        for name, custom, reference in table:
            c = _time(custom, args.repeats)
            copy_samples += _samples(copy_fn, args.repeats)
            ref = _time(reference, args.repeats) if reference and not args.no_reference else None
            rows.append({"op": name, "custom_s": c, "custom_gbs": gb / c[0],
                         "reference_s": ref, "reference_gbs": gb / ref[0] if ref else None})
        copy = _summary(copy_samples)
        copy_gbs = 2 * gb / copy[0]
        print(f"\n## {n:,} float32 ({gb * 1e3:.0f} MB); copy bandwidth {copy_gbs:.1f} GB/s "
              f"(read + write; median of {len(copy_samples)}, one batch after each op; "
              f"{2 * gb / copy[2]:.1f}–{2 * gb / copy[1]:.1f})")
        print("| op | custom GB/s | spread ms | reference GB/s | spread ms | speed-up | % of copy |")
        print("|:--|--:|--:|--:|--:|--:|--:|")
        for row in rows:
            c, ref = row["custom_s"], row["reference_s"]
            row["fraction_of_copy"] = row["custom_gbs"] / copy_gbs
            ref_txt = (f"{row['reference_gbs']:.2f} | {ref[1] * 1e3:.1f}–{ref[2] * 1e3:.1f}"
                       if ref else "– | –")
            speed = f"{ref[0] / c[0]:.1f}x" if ref else "–"
            print(f"| {row['op']} | {row['custom_gbs']:.2f} | {c[1] * 1e3:.1f}–{c[2] * 1e3:.1f} | "
                  f"{ref_txt} | {speed} | {100 * row['fraction_of_copy']:.0f}% |")
        report["sizes"].append({"n": n, "copy_s": copy, "copy_gbs": copy_gbs, "ops": rows})
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
