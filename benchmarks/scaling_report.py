"""The scaling benchmark's tables and plot (``scaling.py --report``): the cost model
against the measured clusters, and its prediction at 16 to 1024 workers.

Imports TensorFlow (the planner traces payload sizes); ``scaling.py``'s driver runs this
in a process of its own.
"""

import math
import os
import sys
from xml.sax.saxutils import escape

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
from network_report import rate_bps, rate_label  # noqa: E402
from tfgc.apps.plots import COLORS, DASHES, Panel  # noqa: E402  (stdlib only)

# BERT-base's encoder (Devlin et al., 2019: 12 layers, hidden 768, feed-forward 3072)
# and pooler, without the embeddings (their gradients are rows, sent on their own path).
BERT_LAYERS, BERT_HIDDEN, BERT_FFN = 12, 768, 3072
# The check's gradients are matrices of rows of this many elements: the policy sends
# vectors (biases) as they are, and a low-rank codec's cost needs a matrix.
ROW = 1024


def gradient_shape(elements):
    """The check's gradient of ``elements`` (a multiple of ``ROW``)."""
    return (elements // ROW, ROW)


def _mean(values):
    return sum(values) / len(values)


# -- the check ----------------------------------------------------------------------

def _figures(run):
    from tfgc.distribute import planner
    return planner.Figures.from_words(run["results"][0]["figure_words"], run["workers"])


def _lines(run, label):
    """The codec's (encode, decode) lines that the run timed for a setting that is not
    one of auto's candidates."""
    from tfgc.distribute import planner
    line = run["results"][0]["codec_lines"][label]
    return planner.Line(*line[:2]), planner.Line(*line[2:])


def check_rows(report):
    """One row per (rate, setting, size, N): the measured median (mean over workers)
    and the model's predictions from the 2-worker link and from the run's own, with
    the codec's CPU from the run's own timings."""
    from tfgc.distribute import costmodel, planner
    runs = [r for r in report["runs"] if r["status"] == "ok"]
    base = {r["rate"]: _figures(r).link() for r in runs if r["workers"] == 2}
    rows = []
    for run in runs:
        if run["rate"] not in base:
            continue
        n, figures = run["workers"], _figures(run)
        own = figures.link()
        by_key = {}
        for result in run["results"]:
            for row in result["rows"]:
                by_key.setdefault((row["label"], row["path"], row["elements"]), []).append(row)
        for (label, path, elements), mine in by_key.items():
            candidate = planner.BY_LABEL.get(label)
            if candidate is not None:  # the planner's own figures and traced bytes
                cpu = planner.cpu_seconds(figures, candidate, path, elements)
                sent = planner.sent_bytes(candidate, path, gradient_shape(elements),
                                          "float32", n)
            else:  # the model's bytes from the payload the strategy counted
                cpu = costmodel.codec_seconds(path, n, elements, *_lines(run, label))
                sent = costmodel.sent(path, n, mine[0]["payload_bytes"])

            def predict(ab):
                return cpu + ab.latency(path, n) + ab.beta * sent

            rows.append({"rate": run["rate"], "workers": n, "label": label, "path": path,
                         "elements": elements, "measured_s": _mean([m["seconds"] for m in mine]),
                         "from_n2_s": predict(base[run["rate"]]), "same_n_s": predict(own),
                         "cpu_s": cpu, "sent_bytes": sent,
                         "counted_bytes": mine[0]["sent_bytes"],
                         "hops": costmodel.hops(path, n)})
    return rows


def byte_differences(checks):
    """Per path, the largest relative difference between the model's bytes and the
    strategy's count."""
    out = {}
    for c in checks:
        diff = abs(c["sent_bytes"] / c["counted_bytes"] - 1)
        out[c["path"]] = max(out.get(c["path"], 0.0), diff)
    return out


def _error(row, key):
    return row[key] / row["measured_s"] - 1.0


def _median(values):
    values = sorted(values)
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


# -- the prediction -----------------------------------------------------------------

def model_gradients(name):
    """(name, shape, dtype) of a model's gradients."""
    if name == "resnet50":
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
        import tf_keras
        net = tf_keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3),
                                             classes=1000)
        return [(v.name, tuple(v.shape), "float32") for v in net.trainable_variables]
    if name == "wide_mlp":
        shapes = [(784, 2048), (2048,), (2048, 2048), (2048,), (2048, 10), (10,)]
        return [(f"v{i}", s, "float32") for i, s in enumerate(shapes)]
    if name == "bert_base":
        h, f = BERT_HIDDEN, BERT_FFN
        out = []
        for layer in range(BERT_LAYERS):
            shapes = [(h, h), (h,)] * 4 + [(h,), (h,), (h, f), (f,), (f, h), (h,), (h,), (h,)]
            out += [(f"l{layer}_{i}", s, "float32") for i, s in enumerate(shapes)]
        return out + [("pooler", (h, h), "float32"), ("pooler_b", (h,), "float32")]
    raise ValueError(f"unknown model {name!r}")


def _split(gradients):
    """The default ``CompressionPolicy``'s split under ``auto``: the gradients it
    compresses, and the bytes of the rest, which ride one float32 all-reduce."""
    import tensorflow as tf

    from tfgc import CompressionPolicy
    from tfgc.compressors import get as get_compressor
    policy, auto = CompressionPolicy(), get_compressor("auto")
    compressed, dense = [], 0
    for name, shape, dtype in gradients:
        if policy.should_compress(tf.TensorSpec(shape, dtype), auto):
            compressed.append((name, shape, dtype))
        else:
            dense += tf.as_dtype(dtype).size * math.prod(shape)
    return compressed, dense


def _source(report):
    """The 2-worker run at the fastest rate: its codec timings are the prediction's."""
    twos = [r for r in report["runs"] if r["status"] == "ok" and r["workers"] == 2]
    if not twos:
        raise SystemExit("scaling report: no 2-worker run succeeded; the model's link and "
                         "the prediction's codec timings come from one")
    return max(twos, key=lambda r: rate_bps(r["rate"]))


def _with_call_cost(figures, call_s):
    """``figures`` with every codec line's fixed cost per call set to ``call_s`` (their
    slopes kept); None keeps the fitted ones."""
    import dataclasses

    from tfgc.distribute import planner
    if call_s is None:
        return figures

    def words(line):
        return tuple(int(round((call_s + line.b * size) * 1e6)) for size in planner.CPU_SIZES)

    return dataclasses.replace(
        figures, encode_us={k: words(figures.encode(k)) for k in figures.encode_us},
        decode_us={k: words(figures.decode(k)) for k in figures.decode_us})


def predict_rows(report, models, workers, rates, alpha_s, error, call_s=None):
    """Communication per step at every (model, N, rate): stock, every setting on every
    compressed gradient, and auto's plan (``planner.make_plan``), from the codec timings
    of the 2-worker check at its fastest rate, each call's fixed cost ``call_s`` (None:
    as fitted).

    Settings left out: a sparse payload on the all-gather, whose sum the model charges
    as a dense one (``costmodel``)."""
    import dataclasses

    import tensorflow as tf

    from tfgc.compressors import get as get_compressor
    from tfgc.distribute import costmodel, planner
    from tfgc.distribute.paths import auto as auto_paths
    source = _source(report)
    cpu = _with_call_cost(_figures(source), call_s)
    # Settings that are not auto's candidates, on their own paths, with their codec's
    # lines as the 2-worker run timed them.
    others = {}
    for config in report["config"]["configs"]:
        spec, _, path = config.rpartition("@")
        if spec in planner.BY_LABEL or (
                path == "allgather" and get_compressor(spec).sparse_entries is not None):
            continue
        encode, decode = _lines(source, spec)
        if call_s is not None:
            encode, decode = planner.Line(call_s, encode.b), planner.Line(call_s, decode.b)
        others[config] = (spec, path, encode, decode)
    rows = []
    for model in models:
        gradients = model_gradients(model)
        compressed, dense = _split(gradients)
        total = dense + sum(4 * math.prod(s) for _, s, _ in compressed)
        for n in workers:
            for gbps in rates:
                ab = costmodel.AlphaBeta.from_rate(gbps, alpha_s * 1e6)
                figures = dataclasses.replace(cpu, num_workers=n, link_us=(0,) * len(cpu.link_us),
                                              link_gbps=gbps, latency_ms=alpha_s * 1e3)
                dense_s = ab.time("allreduce", n, dense) if dense else 0.0
                row = {"model": model, "workers": n, "gbps": gbps,
                       "dense_bytes": total, "stock_s": ab.time("allreduce", n, total)}
                for candidate in planner.CANDIDATES[1:]:
                    path = planner.path_of(candidate, n)
                    seconds = ab.latency(path, n) + sum(
                        planner.cpu_seconds(figures, candidate, path, math.prod(shape))
                        + ab.beta * planner.sent_bytes(candidate, path, shape, dtype, n)
                        for _, shape, dtype in compressed)
                    row[candidate.label + "_s"] = dense_s + seconds
                for config, (spec, path, encode, decode) in others.items():
                    compressor = get_compressor(spec)
                    # On the paths of two rings the dense gradients ride in one of them.
                    riding = (ab.wire("allreduce", n, dense)
                              if path in ("low_rank", "shared_index") else dense_s)
                    row[config + "_s"] = riding + ab.latency(path, n) + sum(
                        costmodel.codec_seconds(path, n, math.prod(shape), encode, decode)
                        + ab.wire(path, n, 4 * auto_paths._payload_words(
                            compressor, tf.TensorShape(shape), tf.float32))
                        for _, shape, _ in compressed)
                plan = planner.make_plan(compressed, figures, error)
                p = plan.predicted()
                row["auto_s"] = dense_s + p["cpu_s"] + p["wire_s"] + p["latency_s"]
                elements = {}
                for e in plan.entries:
                    elements[e.label] = elements.get(e.label, 0) + math.prod(e.shape)
                row["auto_plan"] = {k: v / sum(elements.values()) for k, v in elements.items()}
                rows.append(row)
    return rows


# -- rendering ----------------------------------------------------------------------

def _ms(seconds):
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def render_markdown(report, checks, predictions, alpha_s, floor, call_s=None):
    fixed = [k[:-2] for k in (predictions[0] if predictions else {})
             if k.endswith("_s") and k not in ("stock_s", "auto_s")]
    lines = ["# Scaling: the cost model against measured clusters, and beyond", ""]
    lines += _common.run_header(report) + [""]
    lines += [
        "## The check: 2 to 8 workers on shaped links", "",
        "Each figure: the median of the timed reductions of one float32 gradient (a matrix "
        "of rows of 1024), the mean over workers; the model's prediction from the 2-worker "
        "probe's link (alpha per hop, beta per byte) with the bytes and hops of the path at "
        "N, and the codec's CPU measured in the run itself (ms, and the prediction's error "
        "relative to the measurement).", ""]
    ns = sorted({c["workers"] for c in checks})
    sizes = sorted({c["elements"] for c in checks})
    lines += ["The bytes: the model's (``costmodel.sent``; for auto's candidates the "
              "planner's traced count) against what the strategy counted, per path, the "
              "largest relative difference over sizes, settings and N:", "",
              "| path | largest difference |", "|---|--:|"]
    for path, diff in byte_differences(checks).items():
        lines.append(f"| {path} | {diff:.1%} |")
    lines.append("")
    lines += ["Median absolute error of the prediction from the 2-worker link, over the "
              "settings (and, in brackets, from the run's own probe):", "",
              "| rate | elements | " + " | ".join(f"N={n}" for n in ns) + " |",
              "|---|--:|" + "--:|" * len(ns)]
    for rate in report["config"]["rates"]:
        for size in sizes:
            cells = []
            for n in ns:
                rows = [c for c in checks if (c["rate"], c["elements"], c["workers"]) ==
                        (rate, size, n)]
                cells.append(f"{_median([abs(_error(r, 'from_n2_s')) for r in rows]):.0%} "
                             f"({_median([abs(_error(r, 'same_n_s')) for r in rows]):.0%})"
                             if rows else "–")
            lines.append(f"| {rate_label(rate)} | {size:,} | " + " | ".join(cells) + " |")
    lines += ["", "The probe's link at each N (alpha per hop; the rate a worker's bytes "
              "leave at): what the model takes as fixed, on this machine's cores:", "",
              "| rate | " + " | ".join(f"N={n}" for n in ns) + " |",
              "|---|" + "--:|" * len(ns)]
    runs = {(r["rate"], r["workers"]): _figures(r).link() for r in report["runs"]
            if r["status"] == "ok"}
    for rate in report["config"]["rates"]:
        cells = []
        for n in ns:
            link = runs.get((rate, n))
            cells.append(f"{link.alpha * 1e3:.2f} ms, {8 / link.beta / 1e9:.3g} Gbit/s"
                         if link and link.beta else "–")
        lines.append(f"| {rate_label(rate)} | " + " | ".join(cells) + " |")
    ns = sorted({c["workers"] for c in checks})
    lines += ["", "Measured ms / predicted from N=2 (error):", "",
              "| rate | setting | elements | " + " | ".join(f"N={n}" for n in ns) + " |",
              "|---|---|--:|" + "--:|" * len(ns)]
    keys = sorted({(c["rate"], c["label"], c["path"], c["elements"]) for c in checks},
                  key=lambda k: (rate_bps(k[0]), k[1], k[2], k[3]))
    for rate, label, path, elements in keys:
        cells = []
        for n in ns:
            got = [c for c in checks if (c["rate"], c["label"], c["path"], c["elements"],
                                         c["workers"]) == (rate, label, path, elements, n)]
            cells.append(f"{_ms(got[0]['measured_s'])} / {_ms(got[0]['from_n2_s'])} "
                         f"({_error(got[0], 'from_n2_s'):+.0%})" if got else "–")
        lines.append(f"| {rate_label(rate)} | {label}@{path} | {elements:,} | "
                     + " | ".join(cells) + " |")
    lines += [
        "", "## The prediction: 16 to 1024 workers", "",
        f"Links of alpha = {alpha_s * 1e6:g} us per hop and the rate shown; the codec's CPU "
        "per element of this machine's 2-worker check, and "
        + (f"{call_s * 1e6:g} us per codec call" if call_s is not None
           else "the fixed cost per call fitted there")
        + "; TensorFlow's ring collectives. Not predicted: top-k on the all-gather (the "
        "model charges its sparse sum as a dense one). "
        "Communication per step in ms (the step adds the compute, which does not change "
        f"with N); speed-up = (floor + stock) / (floor + auto) with a compute floor of "
        f"{floor * 1e3:g} ms per step; best fixed = the fastest of the other columns, each "
        "one setting on every compressed gradient, whatever its error (qsgd8 and rqsgd4 "
        "exceed auto's budget; the error-feedback settings have no bound of that kind).", "",
        "| model | N | Gbit/s | stock | " + " | ".join(f"`{c}`" for c in fixed)
        + " | auto | auto's plan (share of elements) | auto / stock | step speed-up | "
        "auto / best fixed |", "|---|--:|--:|--:|" + "--:|" * len(fixed) + "--:|---|--:|--:|--:|"]
    for r in predictions:
        best = min(r[c + "_s"] for c in fixed)
        plan = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["auto_plan"].items(),
                                                          key=lambda kv: -kv[1]))
        lines.append(
            f"| {r['model']} | {r['workers']} | {r['gbps']:g} | {_ms(r['stock_s'])} | "
            + " | ".join(_ms(r[c + "_s"]) for c in fixed)
            + f" | {_ms(r['auto_s'])} | {plan} | {r['auto_s'] / r['stock_s']:.2f} | "
            f"{(floor + r['stock_s']) / (floor + r['auto_s']):.2f}x | "
            f"{r['auto_s'] / best:.2f} |")
    return "\n".join(lines) + "\n"


def render_svg(predictions, models, rates):
    """Per model: predicted communication per step against N (log-log), stock dashed
    and auto solid, one colour per rate."""
    pw, ph, left, top, gap = 330, 240, 70, 50, 60
    width = left + len(models) * (pw + gap)
    body = []
    for mi, model in enumerate(models):
        mine = [r for r in predictions if r["model"] == model]
        if not mine:
            continue
        ns = sorted({r["workers"] for r in mine})
        values = [r[k] for r in mine for k in ("stock_s", "auto_s")]
        lo = 10 ** math.floor(math.log10(min(values) * 1e3))
        hi = 10 ** math.ceil(math.log10(max(values) * 1e3))
        hi = hi if hi > lo else lo * 10
        p = Panel(body, left + mi * (pw + gap), top, pw, ph, (ns[0] / 1.3, ns[-1] * 1.3),
                  (lo, hi), xlog=True, ylog=True)
        p.frame(f"{model}", "workers (log scale)", "ms per step (log)",
                [(n, str(n)) for n in ns],
                [(10 ** e, f"{10 ** e:g}") for e in range(int(math.log10(lo)),
                                                         int(math.log10(hi)) + 1)])
        for i, gbps in enumerate(rates):
            at = sorted((r["workers"], r) for r in mine if r["gbps"] == gbps)
            p.series([(n, r["stock_s"] * 1e3) for n, r in at], COLORS[i], DASHES[1], hollow=True)
            p.series([(n, r["auto_s"] * 1e3) for n, r in at], COLORS[i])
    ly = top + ph + 70
    legend = []
    for i, gbps in enumerate(rates):
        x = left + i * 160
        legend.append(f'<line x1="{x}" y1="{ly - 4}" x2="{x + 28}" y2="{ly - 4}" '
                      f'stroke="{COLORS[i]}" stroke-width="3"/>')
        legend.append(f'<text x="{x + 36}" y="{ly}">{gbps:g} Gbit/s</text>')
    legend.append(f'<text x="{left}" y="{ly + 20}" fill="#444">solid: auto; dashed, hollow: '
                  'stock (float32 ring all-reduce); predicted communication per step</text>')
    height = ly + 34
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{left}" y="20" font-size="14" font-weight="bold">'
            f'{escape("tfgc: the cost model at scale (prediction)")}</text>']
    return "\n".join(head + body + legend + ["</svg>", ""])


def main(json_path, out, overrides=None):
    """Remakes the tables and the plot from the sweep's JSON (``overrides``: prediction
    options that replace the sweep's) and writes them, with the JSON, under ``out``."""
    import json
    with open(json_path) as f:
        report = json.load(f)
    config = report["config"]
    config.update(overrides or {})
    checks = check_rows(report)
    alpha_s = config["alpha_us"] * 1e-6
    if not alpha_s:
        alpha_s = _figures(_source(report)).link().alpha
    floor = config["floor_ms"] / 1e3
    call_us = config.get("call_us", -1.0)
    call_s = call_us * 1e-6 if call_us >= 0 else None
    predictions = predict_rows(report, config["scale_models"], config["scale_workers"],
                               config["scale_rates"], alpha_s, config["error"], call_s)
    report["check_rows"], report["predictions"] = checks, predictions
    report["prediction_alpha_s"] = alpha_s
    md = render_markdown(report, checks, predictions, alpha_s, floor, call_s)
    _common.write_json(out + ".json", report)
    with open(out + ".md", "w") as f:
        f.write(md)
    with open(out + ".svg", "w") as f:
        f.write(render_svg(predictions, config["scale_models"], config["scale_rates"]))
    print(md)
    print(f"wrote {out}.md, {out}.json, {out}.svg")
    return 0
