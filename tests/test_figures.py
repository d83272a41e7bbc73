"""benchmarks/figures.py: the README's PNGs from the stored benchmark results."""

import importlib.util
import json
import os
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_figures():
    spec = importlib.util.spec_from_file_location(
        "tfgc_benchmarks_figures", os.path.join(REPO, "benchmarks", "figures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _load_figures()


def _read(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def test_main_writes_valid_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="scripts/setup.sh installs matplotlib")
    out = tmp_path / "figs"
    assert figures.main(["--results", RESULTS, "--out", str(out)]) == 0
    names = sorted(os.listdir(out))
    assert names == sorted(figures.FIGURES)
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert 10_000 < len(data) < 200_000, (name, len(data))
        # IHDR: width and height, big-endian, right after the chunk header.
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 600 and height >= 300, (name, width, height)


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
            assert figures.network.rate_bps(run["rate"]) == bps
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
    for xkey in ("cumulative_sent_bytes", "train_seconds"):
        got = {label: pts for label, _, pts in figures.convergence_curves(report, xkey)}
        # The figure draws the first model of the sweep (its other models may be
        # partly run).
        model = report["config"]["models"][0]
        want = {r["label"]: [(c[xkey], c["test_accuracy"]) for c in r["curve"]]
                for r in report["runs"] if r["status"] == "ok" and r["model"] == model}
        assert got == want
    labels = [(label, spec) for label, spec, _ in
              figures.convergence_curves(report, "train_seconds")]
    assert sum(figures.is_dense_baseline(label, spec) for label, spec in labels) == 1
