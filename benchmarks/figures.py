"""Figures: the network and convergence benchmarks' results as PNG plots.

    python benchmarks/figures.py                             # results/ -> docs/figures/
    python benchmarks/figures.py --results /tmp/res --out /tmp/figs

Reads the stored results (nothing is rerun, nothing is typed in by hand) and writes:

* ``speedup_vs_link_rate.png`` (``network.json``): median step time and speed-up over
  the stock ``MultiWorkerMirroredStrategy`` against the link rate, per configuration.
* ``bytes_per_worker_vs_n.png`` (``network.json`` and ``bytes_per_step.json``): bytes
  each worker sends per step against the number of workers N: on the shaped links
  (veth counters and the strategy's own count) and, for every compressor of
  ``bytes_per_step.py``, the strategy's count on the trainer's MLP.
* ``convergence_<model>_accuracy_vs_bytes.png`` and
  ``convergence_<model>_accuracy_vs_time.png`` for each model of ``convergence.json``
  (``mlp``, ``cnn``): test accuracy after each epoch against the cumulative bytes sent
  per worker and against training time, for every compressor; the right panel zooms on
  the runs near the dense one.

The stock strategy (or the dense ``none`` compressor, which the tests check is
bit-identical to it) is drawn in black in every figure. Needs matplotlib (Agg backend;
``scripts/setup.sh`` installs it). The driver imports neither TensorFlow nor tfgc.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (also puts the repo root on sys.path)
import network_report  # noqa: E402  (stdlib only: rate parsing and names)
from tfgc.apps.plots import fmt_bytes  # noqa: E402  (stdlib only)

DEFAULT_OUT = os.path.join(_common.REPO_ROOT, "docs", "figures")
REQUIRED = ("network.json", "bytes_per_step.json", "convergence.json")
FIGURES = ("speedup_vs_link_rate.png", "bytes_per_worker_vs_n.png")
# Per model of convergence.json: CONVERGENCE_FIGURE.format(model=..., x=...).
CONVERGENCE_FIGURE = "convergence_{model}_accuracy_vs_{x}.png"
CONVERGENCE_X_NAMES = (("cumulative_sent_bytes", "bytes"), ("train_seconds", "time"))
DPI = 100
STOCK = network_report.STOCK
STOCK_LABEL = "stock MultiWorkerMirroredStrategy"
BASELINE_COLOR = "black"
# Other processes took more than this share of the cores during a timed run: marked.
BUSY_SHARE = 0.25


class MissingResults(FileNotFoundError):
    """A results file figures.py needs is not there."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=_common.RESULTS_DIR,
                   help="directory with network.json, bytes_per_step.json and "
                        "convergence.json (default: benchmarks/results)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="directory the PNGs are written to (default: docs/figures)")
    return p.parse_args(argv)


def load_results(results_dir):
    """{file name: parsed JSON} for every file in REQUIRED; MissingResults names the absent."""
    missing = [name for name in REQUIRED
               if not os.path.isfile(os.path.join(results_dir, name))]
    if missing:
        hints = {"network.json": "sudo python benchmarks/network.py",
                 "bytes_per_step.json": "python benchmarks/bytes_per_step.py",
                 "convergence.json": "python benchmarks/convergence.py"}
        raise MissingResults(
            "figures.py: missing results file(s) in " + os.path.abspath(results_dir) + ": "
            + "; ".join(f"{name} (written by `{hints[name]}`)" for name in missing))
    out = {}
    for name in REQUIRED:
        with open(os.path.join(results_dir, name)) as f:
            out[name] = json.load(f)
    return out


# ---------------------------------------------------------------------------------
# Series: plain data pulled out of the results, no plotting (the tests check these).

def _ok(runs):
    return [r for r in runs if r.get("status") == "ok"]


def _configs_in_order(report):
    """Stock first, then the configurations in the order the run was asked for."""
    asked = [STOCK] + list(report.get("config", {}).get("configs", []))
    seen = {r["config"] for r in _ok(report["runs"])}
    return [c for c in asked if c in seen] + sorted(seen - set(asked))


def network_speedups(report, model=None, workers=None):
    """{config: [(rate in bit/s, speed-up over stock, run), ...]} of the step-time sweep.

    The speed-ups are the JSON's own (stock's median step time / the configuration's at
    the same model, rate and N; over rounds, the median of each round's:
    ``network_report.combine_rounds``). ``model`` and ``workers`` default to the first
    of the run's configuration.
    """
    cfg = report.get("config", {})
    model = model or cfg.get("models", ["wide_mlp"])[0]
    workers = workers or cfg.get("workers", [4])[0]
    out = {}
    for c in _configs_in_order(report):
        pts = sorted((network_report.rate_bps(r["rate"]), r["speedup"], r)
                     for r in _ok(network_report.combine_rounds(report["runs"]))
                     if r["kind"] == "main" and r["config"] == c and r["model"] == model
                     and r["workers"] == workers and r.get("speedup") is not None)
        if pts:
            out[c] = pts
    return out


def network_bytes_vs_n(report, model=None):
    """{config: [(N, veth bytes sent per worker and step, strategy's figure), ...]}.

    At the bytes sweep's rate (``config.bytes_rate``), from both the bytes sweep and the
    step-time sweep (which supplies the N it already ran), as network.py's own plot does.
    """
    cfg = report.get("config", {})
    model = model or cfg.get("models", ["wide_mlp"])[0]
    rate = cfg.get("bytes_rate", "10gbit")
    out = {}
    for c in _configs_in_order(report):
        by_n = {}
        for r in _ok(report["runs"]):
            if r["config"] == c and r["model"] == model and r["rate"] == rate:
                by_n.setdefault(r["workers"], r)  # first run at this N
        if by_n:
            out[c] = [(n, by_n[n]["veth_tx_per_step"], by_n[n]["strategy_sent_per_step"])
                      for n in sorted(by_n)]
    return out


def bytes_per_step_vs_n(report):
    """{(model, spec): [(N, sent bytes per worker and step, wire formula's), ...]}."""
    out = {}
    for run in report["runs"]:
        for r in run["results"]:
            out.setdefault((run["model"], r["spec"]), []).append(
                (run["workers"], r["sent_bytes"], r["expected"]["sent"]))
    return {k: sorted(v) for k, v in out.items()}


def convergence_models(report):
    """The sweep's models that have at least one finished run, in the sweep's order."""
    done = {r["model"] for r in _ok(report["runs"])}
    return [m for m in report["config"]["models"] if m in done]


def convergence_figures(report):
    """[(model, curve field, file name), ...]: the convergence figures of a report."""
    return [(m, xkey, CONVERGENCE_FIGURE.format(model=m, x=x))
            for m in convergence_models(report) for xkey, x in CONVERGENCE_X_NAMES]


def figure_names(convergence_report):
    """Every file make_figures writes, given convergence.json's report."""
    return list(FIGURES) + [name for _, _, name in convergence_figures(convergence_report)]


def convergence_curves(report, xkey, model):
    """[(label, spec, [(x, test accuracy), ...]), ...] per run, in the sweep's order.

    ``xkey`` is a curve field: ``cumulative_sent_bytes`` or ``train_seconds``. Points
    whose accuracy is NaN, and (for bytes, plotted on a log axis) x <= 0, are left out.
    """
    out = []
    for r in _ok(report["runs"]):
        if r["model"] != model:
            continue
        pts = [(c[xkey], c["test_accuracy"]) for c in r["curve"]
               if not math.isnan(c["test_accuracy"])
               and (xkey != "cumulative_sent_bytes" or c[xkey] > 0)]
        if pts:
            out.append((r["label"], r["spec"], pts))
    return out


def is_dense_baseline(label, spec):
    """The dense run with the baseline optimizer: convergence.py's ``none``."""
    return spec == "none" and label == "none"


# ---------------------------------------------------------------------------------
# Formatting.

def config_label(config):
    """'onebit@reduce_scatter' -> 'onebit, reduce_scatter'; stock -> the strategy's name."""
    if config == STOCK:
        return STOCK_LABEL
    spec, _, comm = config.partition("@")
    return f"{spec}, {comm}" if comm else spec


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7,
                         "figure.titlesize": 9})
    return plt


def _bytes_axis(ax, axis="y"):
    from matplotlib.ticker import FuncFormatter, LogLocator
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(LogLocator(base=10))
    target.set_major_formatter(FuncFormatter(lambda v, _: fmt_bytes(v)))


def _save(fig, path):
    """PNG at DPI, reduced to a 256-colour palette (a third of the size, same look)."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image  # a dependency of matplotlib

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    buf.seek(0)
    with Image.open(buf) as img:
        # Written by Pillow: no metadata, so the file does not change with the version.
        img.convert("RGB").quantize(colors=256).save(path, format="PNG", optimize=True)


def _style(i):
    """Colour, line style and marker of the i-th non-baseline series (tab10, then dashed)."""
    import matplotlib.pyplot as plt
    return plt.get_cmap("tab10")(i % 10), ("-", "--", ":")[(i // 10) % 3], "os^"[(i // 10) % 3]


def _colors(plt, keys):
    cmap = plt.get_cmap("tab10")
    colors, i = {}, 0
    for k in keys:
        if k == STOCK:
            colors[k] = BASELINE_COLOR
        else:
            colors[k] = cmap(i % 10)
            i += 1
    return colors


def _network_setup(report, short=False):
    """'wide_mlp (5,824,522 parameters), batch 32 per worker, fashion_mnist, 2-core ...'"""
    cfg = report.get("config", {})
    runs = _ok(report["runs"])
    params = runs[0].get("params") if runs else None
    model = cfg.get("models", ["?"])[0]
    link = report.get("link", "").split(";")[0]
    parts = [f"{model}" + (f" ({params:,} parameters)" if params else ""),
             f"batch {cfg.get('batch_size', '?')} per worker, {cfg.get('dataset', '?')}",
             ]
    if short:
        return ", ".join(parts)
    parts += [f"{report.get('cpu_count', '?')}-core machine",
             f"links: tc {link}" if link else "",
             f"run {report['started'][:10]}" if report.get("started") else ""]
    return ", ".join(p for p in parts if p)


# ---------------------------------------------------------------------------------
# Figures.

def plot_speedup(report, path):
    plt = _plt()
    cfg = report.get("config", {})
    workers = cfg.get("workers", [4])[0]
    series = network_speedups(report, workers=workers)
    colors = _colors(plt, series)
    busy_limit = BUSY_SHARE * (report.get("cpu_count") or os.cpu_count() or 1)
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(9.6, 4.4))
    rates = sorted({x for pts in series.values() for x, _, _ in pts})
    for c, pts in series.items():
        xs = [x for x, _, _ in pts]
        med = [r["median_ms"] for _, _, r in pts]
        err = [[r["median_ms"] - r["p10_ms"] for _, _, r in pts],
               [r["p90_ms"] - r["median_ms"] for _, _, r in pts]]
        base = c == STOCK
        style = dict(color=colors[c], marker="o", markersize=4,
                     linewidth=2.2 if base else 1.4, label=config_label(c))
        ax_t.errorbar(xs, med, yerr=err, capsize=2, **style)
        ax_s.plot(xs, [s for _, s, _ in pts], linestyle="--" if base else "-", **style)
        busy = [(x, s) for x, s, r in pts if r.get("other_cpu_cores", 0) > busy_limit]
        if busy:
            ax_s.scatter(*zip(*busy), s=110, facecolors="none", edgecolors="grey")
    for ax in (ax_t, ax_s):
        ax.set_xscale("log")
        ax.set_xticks(rates, [network_report.rate_label(r) for r in rates])
        ax.minorticks_off()
        ax.set_xlim(rates[0] / 1.6, rates[-1] * 1.6)
        ax.set_xlabel("link rate per worker (bit/s, log scale)")
        ax.grid(True, alpha=0.3)
    ax_t.set_ylim(bottom=0)
    ax_t.set_ylabel("median step time (ms; bars: 10th-90th percentile)")
    ax_t.set_title(f"step time, {workers} workers")
    ax_s.set_ylim(bottom=0)
    ax_s.set_ylabel("speed-up over stock (stock step time / step time, ×)")
    ax_s.set_title(f"speed-up over stock MultiWorkerMirroredStrategy, {workers} workers")
    handles, labels = ax_s.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    fig.suptitle("Over shaped links (benchmarks/network.py): " + _network_setup(report),
                 wrap=True)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    _save(fig, path)


def plot_bytes_vs_n(net, bps, path):
    plt = _plt()
    fig, (ax_n, ax_b) = plt.subplots(1, 2, figsize=(10, 5.6), layout="constrained")
    # Left: the wide MLP over shaped links, measured on the veth and counted by tfgc.
    series = network_bytes_vs_n(net)
    colors = _colors(plt, series)
    ns = sorted({n for pts in series.values() for n, _, _ in pts})
    for c, pts in series.items():
        base = c == STOCK
        xs = [n for n, _, _ in pts]
        ax_n.plot(xs, [v for _, v, _ in pts], color=colors[c], marker="o", markersize=4,
                  linewidth=2.2 if base else 1.4, label=config_label(c))
        ax_n.plot(xs, [s for _, _, s in pts], color=colors[c], marker="o", markersize=4,
                  markerfacecolor="white", linestyle=":", linewidth=1)
    ax_n.plot([], [], color="grey", marker="o", label="solid: veth tx bytes (on the wire)")
    ax_n.plot([], [], color="grey", marker="o", markerfacecolor="white", linestyle=":",
              label="dotted: the strategy's count\n(stock: ring formula 2(N-1)/N)")
    cfg = net.get("config", {})
    ax_n.set_title(f"{_network_setup(net, short=True)},\n"
                   f"{network_report.rate_label(cfg.get('bytes_rate', '10gbit'))} links "
                   "(benchmarks/network.py)")
    ax_n.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    # Right: every compressor of bytes_per_step.py on the trainer's MLP.
    bcfg = bps.get("config", {})
    specs = bytes_per_step_vs_n(bps)
    i = 0
    for (model, spec), pts in specs.items():
        if spec == "none":
            color, ls, mk, lw, name = BASELINE_COLOR, "-", "o", 2.2, "none (dense ring = stock)"
        else:
            (color, ls, mk), lw, name, i = _style(i), 1.2, spec, i + 1
        ax_b.plot([n for n, _, _ in pts], [v for _, v, _ in pts], color=color, marker=mk,
                  markersize=3, linewidth=lw, linestyle=ls, label=name)
    bns = sorted({n for pts in specs.values() for n, _, _ in pts})
    match = "= wire formula" if bps.get("all_match") else "NOT all = wire formula"
    ax_b.set_title(f"{'/'.join(bcfg.get('models', ['?']))} on {bcfg.get('dataset', '?')}, "
                   f"batch {bcfg.get('batch_size', '?')} per worker, every compressor:\n"
                   f"the strategy's count, {match} (benchmarks/bytes_per_step.py)")
    ax_b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)
    for ax, xs in ((ax_n, ns), (ax_b, bns)):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(n) for n in xs])
        ax.minorticks_off()
        ax.set_xlim(xs[0] / 1.2, xs[-1] * 1.2)
        _bytes_axis(ax)
        ax.set_xlabel("workers N (log scale)")
        ax.set_ylabel("bytes sent per worker per step (log scale)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Bytes each worker sends per step against the number of workers "
                 f"({net.get('cpu_count', '?')}-core machine)")
    _save(fig, path)


CONVERGENCE_X = {
    "cumulative_sent_bytes": ("cumulative bytes sent per worker (log scale)", True),
    "train_seconds": ("training time, s (evaluations left out)", False),
}


def plot_convergence(report, xkey, path, model, zoom_points=0.03):
    """Two panels: every run, and the runs that come within zoom_points of dense's best."""
    plt = _plt()
    xlabel, xlog = CONVERGENCE_X[xkey]
    curves = convergence_curves(report, xkey, model)
    cfg = report["config"]
    fig, (ax_all, ax_zoom) = plt.subplots(1, 2, figsize=(10, 4.6), layout="constrained")
    i = 0
    dense_best = None
    for label, spec, pts in curves:
        base = is_dense_baseline(label, spec)
        if spec == "none":
            color, ls, mk = BASELINE_COLOR, "-" if base else "--", "o"
            lw = 2.2 if base else 1.4
            name = (f"{label} (dense = {STOCK_LABEL})" if base
                    else f"{label} (dense, plain SGD)")
        else:
            (color, ls, mk), lw, name, i = _style(i), 1.1, label, i + 1
        if base:
            dense_best = max(a for _, a in pts)
        xs, ys = zip(*pts)
        for ax in (ax_all, ax_zoom):
            ax.plot(xs, ys, color=color, linestyle=ls, linewidth=lw, marker=mk,
                    markersize=2.5, label=name, zorder=3 if spec == "none" else 2)
    ys_all = [a for _, _, pts in curves for _, a in pts]
    lo = math.floor(min(ys_all) * 20) / 20
    hi = math.ceil(max(ys_all) * 50) / 50
    ax_all.set_ylim(lo, hi)
    ax_all.set_title("every run")
    if dense_best is not None:
        ax_zoom.set_ylim(dense_best - zoom_points, hi)
        ax_zoom.set_title(f"zoom: within {zoom_points * 100:g} points of dense's best "
                          f"({dense_best:.3f})")
    for ax in (ax_all, ax_zoom):
        if xlog:
            ax.set_xscale("log")
            _bytes_axis(ax, "x")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (after each epoch)")
        ax.grid(True, alpha=0.3)
    ax_zoom.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    epochs = cfg.get("epochs", {})
    ep = epochs.get(model) if isinstance(epochs, dict) else epochs
    what = "cumulative bytes sent" if xlog else "training time"
    loads = [r["load_before"] for r in _ok(report["runs"])
             if r["model"] == model and r.get("load_before") is not None]
    busy = (f" (load average before a run: {min(loads):.1f} to {max(loads):.1f})"
            if loads and not xlog else "")
    n_runs, n_settings = len(curves), len(report.get("settings", ())) or len(curves)
    partial = f" ({n_runs} of {n_settings} settings run)" if n_runs < n_settings else ""
    fig.suptitle(
        f"Test accuracy vs {what} (benchmarks/convergence.py): {model} on {cfg['dataset']}, "
        f"{cfg['workers']} workers, batch {cfg['batch_size']} per worker, {ep} epochs, "
        f"one run each{partial}, {report.get('cpu_count', '?')}-core machine{busy}",
        wrap=True)
    _save(fig, path)


def make_figures(results_dir, out_dir):
    """Writes FIGURES into out_dir from results_dir; returns their paths."""
    res = load_results(results_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in FIGURES]
    plot_speedup(res["network.json"], paths[0])
    plot_bytes_vs_n(res["network.json"], res["bytes_per_step.json"], paths[1])
    conv = res["convergence.json"]
    for model, xkey, name in convergence_figures(conv):
        paths.append(os.path.join(out_dir, name))
        plot_convergence(conv, xkey, paths[-1], model)
    return paths


def main(argv=None):
    args = parse_args(argv)
    paths = make_figures(args.results, args.out)
    for p in paths:
        print(f"wrote {os.path.relpath(p)} ({os.path.getsize(p) / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MissingResults as e:
        print(e, file=sys.stderr)
        sys.exit(2)
