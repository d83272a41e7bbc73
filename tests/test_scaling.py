"""benchmarks/scaling.py's driver and report: its arguments, the check's arithmetic and
the prediction (the check's clusters need root and shaped links: the benchmark, not
the suite)."""

import pytest

from cluster_scripts import benchmark_module
from tfgc.distribute import costmodel, planner

scaling = benchmark_module("scaling")
report_lib = benchmark_module("scaling_report")


@pytest.mark.parametrize("argv, words", [
    (["--workers", "3", "4"], "2 among them"),
    (["--configs", "qsgd8@ring"], "SETTING@PATH"),
    (["--sizes", "5000"], "multiples of 1024"),
    (["--scale_rates", "0"], "--scale_rates > 0"),
])
def test_bad_arguments_stop_with_a_message(argv, words, capsys):
    with pytest.raises(SystemExit):
        scaling.parse_args(argv)
    assert words in capsys.readouterr().err


def _figures(n, ns_per_element=2.0, hop_s=1e-3, gbps=0.5):
    """Planner figures as a worker records them: an all-reduce probe over a link of
    ``hop_s`` per hop, and every candidate's codec at ``ns_per_element`` plus 50 us."""
    link = costmodel.AlphaBeta(hop_s, 8 / (gbps * 1e9))
    probe = tuple(int(round(link.time("allreduce", n, s) * 1e6)) for s in planner.LINK_SIZES)
    codec = tuple(int(round(50 + ns_per_element * size / 1e3)) for size in planner.CPU_SIZES)
    labels = [c.label for c in planner.CANDIDATES[1:]]
    return planner.Figures(n, probe, dict.fromkeys(labels, codec),
                           dict.fromkeys(labels, codec)).words()


def _report(slow=1.0):
    """A sweep of 2 and 4 workers whose measured times are the model's, the 4-worker
    ones times ``slow``."""
    runs = []
    for n in (2, 4):
        words = _figures(n)
        figures = planner.Figures.from_words(words, n)
        link = figures.link()
        rows = []
        for label, path in (("qsgd8", "reduce_scatter"), ("bf16", "allreduce")):
            candidate = planner.BY_LABEL[label]
            e = 65536
            seconds = (planner.cpu_seconds(figures, candidate, path, e)
                       + link.latency(path, n)
                       + link.beta * planner.sent_bytes(candidate, path, (64, 1024), "float32", n))
            counted = planner.sent_bytes(candidate, path, (64, 1024), "float32", n)
            rows.append({"label": label, "path": path, "elements": e,
                         "seconds": seconds * (slow if n == 4 else 1.0),
                         "sent_bytes": counted, "payload_bytes": 1})
        # A setting that is not a candidate: its codec's lines and counted payload.
        payload = 4 * 4 * (64 + 1024)
        seconds = (costmodel.codec_seconds("low_rank", n, 65536, planner.Line(1e-4, 1e-9),
                                           planner.Line(1e-4, 1e-9))
                   + link.time("low_rank", n, payload))
        rows.append({"label": "powersgd:rank=4", "path": "low_rank", "elements": 65536,
                     "seconds": seconds * (slow if n == 4 else 1.0),
                     "sent_bytes": int(costmodel.ring_sent(payload, n)) + 40,
                     "payload_bytes": payload})
        results = [{"rank": r, "workers": n, "figure_words": words, "rows": rows,
                    "codec_lines": {"powersgd:rank=4": [1e-4, 1e-9, 1e-4, 1e-9]}}
                   for r in range(n)]
        runs.append({"workers": n, "rate": "1gbit", "status": "ok", "results": results})
    return {"runs": runs, "config": {"rates": ["1gbit"], "configs": [
        "qsgd8@reduce_scatter", "bf16@allreduce", "powersgd:rank=4@low_rank"]}}


def test_the_check_predicts_a_model_cluster_exactly_and_sees_a_slower_one():
    rows = report_lib.check_rows(_report())
    assert len(rows) == 6
    for row in rows:
        # The same link at both sizes: the prediction from N=2 is the run's own.
        assert row["from_n2_s"] == pytest.approx(row["measured_s"], rel=1e-3)
        assert row["same_n_s"] == pytest.approx(row["measured_s"], rel=1e-3)
        assert row["hops"] == costmodel.hops(row["path"], row["workers"])
    # The bytes: the candidates' as counted; PowerSGD's counted 40 more than the model.
    diffs = report_lib.byte_differences(rows)
    assert diffs["reduce_scatter"] == diffs["allreduce"] == 0.0
    assert diffs["low_rank"] == pytest.approx(40 / (costmodel.ring_sent(4 * 4 * 1088, 2) + 40))
    slow = report_lib.check_rows(_report(slow=2.0))
    for row in slow:
        expected = -0.5 if row["workers"] == 4 else 0.0
        assert report_lib._error(row, "from_n2_s") == pytest.approx(expected, abs=1e-3)


def test_the_prediction_compresses_on_a_slow_link_and_equals_stock_on_a_fast_one():
    rows = report_lib.predict_rows(_report(), ["wide_mlp"], [16, 64], [1.0, 100.0], 50e-6,
                                   0.05)
    by = {(r["workers"], r["gbps"]): r for r in rows}
    for n in (16, 64):
        slow, fast = by[(n, 1.0)], by[(n, 100.0)]
        assert slow["auto_s"] < 0.7 * slow["stock_s"]
        assert "fp32" not in slow["auto_plan"] or slow["auto_plan"]["fp32"] < 0.01
        # On the fast link every gradient goes as float32, in the one all-reduce
        # that stock pays too.
        assert fast["auto_plan"] == {"fp32": 1.0}
        assert fast["auto_s"] == pytest.approx(fast["stock_s"], rel=1e-9)
        # The setting that is not a candidate is predicted on its own path.
        assert fast["powersgd:rank=4@low_rank_s"] > 0
    # The all-reduce's latency grows with the hops: stock is slower on more workers.
    assert by[(64, 100.0)]["stock_s"] > by[(16, 100.0)]["stock_s"]
