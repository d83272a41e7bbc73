"""benchmarks/retrace.py's summary (the clusters themselves are the benchmark's)."""

import pytest

from cluster_scripts import benchmark_module

retrace = benchmark_module("retrace")


def _run(first, retraces, building, step):
    return {"first_s": first, "retrace_s": retraces, "building_s": building, "step_s": step}


def test_medians_pool_every_retrace_of_every_round_and_compare_with_stock():
    runs = {"stock": [_run(8.0, [3.0, 4.0], [0.0, 0.0], 0.30),
                      _run(9.0, [5.0, 6.0], [0.0, 0.0], 0.40)],
            "powersgd": [_run(12.0, [6.0, 7.0], [1.0, 1.2], 0.25),
                         _run(14.0, [9.0, 10.0], [1.4, 2.0], 0.35)]}
    summary = retrace.summarize(runs)
    assert summary["stock"]["retrace_s"] == 4.5  # the median of 3, 4, 5, 6
    assert summary["powersgd"]["retrace_s"] == 8.0 and summary["powersgd"]["first_s"] == 13.0
    assert summary["powersgd"]["building_s"] == pytest.approx(1.3)
    assert summary["powersgd"]["retrace_vs_stock"] == pytest.approx(8.0 / 4.5)
    assert summary["stock"]["retrace_vs_stock"] == 1.0
    table = "\n".join(retrace.render({"app": "EfficientNetB0", "summary": summary}))
    assert "| `powersgd` | 13.00 s | 8.00 s | 1.30 s | 1.78x | 300 ms |" in table
    # Without stock among the settings there is nothing to compare with.
    alone = retrace.summarize({"powersgd": runs["powersgd"]})
    assert "retrace_vs_stock" not in alone["powersgd"]


def test_bad_counts_fail_at_parse_time():
    for flag in ("--rounds", "--retraces", "--steps"):
        with pytest.raises(SystemExit):
            retrace.parse_args([flag, "0"])
