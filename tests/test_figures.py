"""benchmarks/figures.py: the PNGs of the README and docs/results.md from the stored
benchmark results."""

import json
import os
import re
import shutil

import pytest

from cluster_scripts import REPO, benchmark_module

RESULTS = os.path.join(REPO, "benchmarks", "results")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

figures = benchmark_module("figures")


def _read(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def test_main_writes_valid_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="scripts/setup.sh installs matplotlib")
    out = tmp_path / "figs"
    assert figures.main(["--results", RESULTS, "--out", str(out)]) == 0
    names = sorted(os.listdir(out))
    conv = _read("convergence.json")
    assert names == sorted(figures.figure_names(conv))
    # Two figures per model that has finished runs, and the two network ones.
    models = sorted({r["model"] for r in conv["runs"] if r["status"] == "ok"})
    assert len(names) == 2 + 2 * len(models)
    for model in models:
        assert f"convergence_{model}_accuracy_vs_bytes.png" in names
        assert f"convergence_{model}_accuracy_vs_time.png" in names
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert 10_000 < len(data) < 200_000, (name, len(data))
        # IHDR: width and height, big-endian, right after the chunk header.
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 600 and height >= 300, (name, width, height)


def _page_links(page):
    """The Markdown links (``![..](target)`` images included) of ``page``, a path from the
    repository root: (is an image, target resolved from the root), anchors dropped."""
    with open(os.path.join(REPO, page)) as f:
        text = f.read()
    links = []
    for bang, target in re.findall(r"(!?)\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)", text):
        if not re.match(r"[a-z]+:", target):
            path = os.path.normpath(os.path.join(os.path.dirname(page), target))
            links.append((bool(bang), path))
    return links


def test_every_figure_is_embedded_where_users_read_it():
    # Users read the README and the pages under docs/ that it links. docs/results.md, one
    # of them, shows every figure that figures.py writes (the README shows some too).
    pages = ["README.md"] + sorted({t for is_image, t in _page_links("README.md")
                                    if not is_image and t.startswith("docs" + os.sep)
                                    and t.endswith(".md")})
    assert os.path.join("docs", "results.md") in pages
    shown = {page: {t for is_image, t in _page_links(page) if is_image} for page in pages}
    for name in figures.figure_names(_read("convergence.json")):
        path = os.path.join("docs", "figures", name)
        assert os.path.isfile(os.path.join(REPO, path)), name
        assert path in shown[os.path.join("docs", "results.md")], name
    # Every embedded image of those pages exists.
    for page, images in shown.items():
        for path in images:
            assert os.path.isfile(os.path.join(REPO, path)), (page, path)


def test_missing_results_file_is_named(tmp_path):
    for name in figures.REQUIRED:
        if name != "convergence.json":
            shutil.copy(os.path.join(RESULTS, name), tmp_path / name)
    with pytest.raises(FileNotFoundError, match=r"convergence\.json"):
        figures.main(["--results", str(tmp_path), "--out", str(tmp_path / "figs")])
    assert not (tmp_path / "figs").exists()


def test_speedups_are_the_json_ones():
    report = _read("network.json")
    got = figures.network_speedups(report)
    # Independently: every ok step-time run of the first model and N, keyed by config and
    # rate string; its speed-up as stored, and as stock's median over its own.
    model, n = report["config"]["models"][0], report["config"]["workers"][0]
    main = [r for r in report["runs"] if r["kind"] == "main" and r["status"] == "ok"
            and r["model"] == model and r["workers"] == n]
    stock_ms = {r["rate"]: r["median_ms"] for r in main if r["config"] == "stock"}
    want = {(r["config"], r["rate"]): r["speedup"] for r in main}
    assert want, "no step-time runs in network.json"
    flat = {}
    for config, pts in got.items():
        for bps, speedup, run in pts:
            assert figures.network_report.rate_bps(run["rate"]) == bps
            flat[(config, run["rate"])] = speedup
    assert flat == want
    for (config, rate), speedup in flat.items():
        assert speedup == pytest.approx(stock_ms[rate] / next(
            r["median_ms"] for r in main if (r["config"], r["rate"]) == (config, rate)))
    # Sorted by rate and stock first (the baseline), at 1x.
    assert list(got)[0] == "stock"
    assert all(s == pytest.approx(1.0) for _, s, _ in got["stock"])
    for pts in got.values():
        assert [b for b, _, _ in pts] == sorted(b for b, _, _ in pts)


def test_bytes_vs_n_are_the_json_ones():
    report = _read("network.json")
    got = figures.network_bytes_vs_n(report)
    rate, model = report["config"]["bytes_rate"], report["config"]["models"][0]
    want = {}
    for r in report["runs"]:
        if r["status"] == "ok" and r["rate"] == rate and r["model"] == model:
            want.setdefault(r["config"], {})[r["workers"]] = (
                r["veth_tx_per_step"], r["strategy_sent_per_step"])
    assert {c: {n: (v, s) for n, v, s in pts} for c, pts in got.items()} == want
    assert sorted({n for pts in got.values() for n, _, _ in pts}) == \
        sorted(set(report["config"]["bytes_workers"]))

    bps = _read("bytes_per_step.json")
    per_spec = figures.bytes_per_step_vs_n(bps)
    for run in bps["runs"]:
        for r in run["results"]:
            assert (run["workers"], r["sent_bytes"], r["expected"]["sent"]) in \
                per_spec[(run["model"], r["spec"])]


def test_convergence_curves_are_the_json_ones():
    report = _read("convergence.json")
    models = figures.convergence_models(report)
    assert models == [m for m in report["config"]["models"]
                      if any(r["model"] == m and r["status"] == "ok" for r in report["runs"])]
    for model in models:
        for xkey in ("cumulative_sent_bytes", "train_seconds"):
            got = {label: pts for label, _, pts in
                   figures.convergence_curves(report, xkey, model)}
            want = {r["label"]: [(c[xkey], c["test_accuracy"]) for c in r["curve"]]
                    for r in report["runs"] if r["status"] == "ok" and r["model"] == model}
            assert got == want
        labels = [(label, spec) for label, spec, _ in
                  figures.convergence_curves(report, "train_seconds", model)]
        assert sum(figures.is_dense_baseline(label, spec) for label, spec in labels) == 1


def _conv_report():
    def run(model, label, accs, status="ok", spec=None):
        return {"model": model, "label": label, "spec": spec or label, "status": status,
                "curve": [{"test_accuracy": a, "cumulative_sent_bytes": 1e6 * (i + 1),
                           "train_seconds": 10.0 * (i + 1)} for i, a in enumerate(accs)]}
    return {"config": {"models": ["mlp", "cnn", "resnet"], "dataset": "fashion_mnist",
                       "workers": 4, "batch_size": 64, "epochs": {"mlp": 2, "cnn": 3}},
            "settings": [{}, {}], "cpu_count": 2,
            "runs": [run("mlp", "none", [0.5, 0.6]), run("mlp", "onebit", [0.4, float("nan")]),
                     run("cnn", "none", [0.7, 0.8, 0.85]), run("cnn", "qsgd", [0.1], "failed"),
                     run("resnet", "none", [0.1], "failed")]}


def test_convergence_series_from_a_hand_made_report():
    report = _conv_report()
    # resnet has only a failed run: no figure for it.
    assert figures.convergence_models(report) == ["mlp", "cnn"]
    assert figures.figure_names(report)[2:] == [
        "convergence_mlp_accuracy_vs_bytes.png", "convergence_mlp_accuracy_vs_time.png",
        "convergence_cnn_accuracy_vs_bytes.png", "convergence_cnn_accuracy_vs_time.png"]
    # The NaN point is left out; the failed run is not drawn.
    assert figures.convergence_curves(report, "train_seconds", "mlp") == [
        ("none", "none", [(10.0, 0.5), (20.0, 0.6)]), ("onebit", "onebit", [(10.0, 0.4)])]
    assert figures.convergence_curves(report, "cumulative_sent_bytes", "cnn") == [
        ("none", "none", [(1e6, 0.7), (2e6, 0.8), (3e6, 0.85)])]


def test_each_convergence_figure_draws_its_own_model(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="scripts/setup.sh installs matplotlib")
    drawn = {}

    def record(fig, path):
        labels = sorted({line.get_label() for ax in fig.axes for line in ax.get_lines()})
        drawn[os.path.basename(path)] = (fig._suptitle.get_text(), labels)
        import matplotlib.pyplot as plt
        plt.close(fig)

    monkeypatch.setattr(figures, "_save", record)
    report = _conv_report()
    for model in ("mlp", "cnn"):
        figures.plot_convergence(report, "train_seconds", str(tmp_path / f"{model}.png"), model)
    title, labels = drawn["mlp.png"]
    assert "mlp on fashion_mnist" in title and "2 epochs" in title
    assert any(lbl.startswith("onebit") for lbl in labels)
    title, labels = drawn["cnn.png"]
    assert "cnn on fashion_mnist" in title and "3 epochs" in title
    assert not any(lbl.startswith("onebit") for lbl in labels)
