"""benchmarks/gan_quality.py's arithmetic and arguments (its runs train a GAN for
minutes: the benchmark, not the suite)."""

import numpy as np
import pytest

from cluster_scripts import benchmark_module

gq = benchmark_module("gan_quality")


def test_the_frechet_distance_of_diagonal_gaussians_is_its_closed_form():
    # For commuting (here diagonal) covariances the root is elementwise:
    # |m1 - m2|^2 + sum (sqrt(s1) - sqrt(s2))^2.
    m1, m2 = np.array([0.0, 1.0, -2.0]), np.array([0.5, 1.0, 0.0])
    s1, s2 = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 0.25])
    expected = np.sum((m1 - m2) ** 2) + np.sum((np.sqrt(s1) - np.sqrt(s2)) ** 2)
    got = gq.frechet_distance((m1, np.diag(s1)), (m2, np.diag(s2)))
    assert got == pytest.approx(expected, rel=1e-9)


def test_the_frechet_distance_is_zero_only_between_equal_moments():
    rng = np.random.default_rng(0)
    a = gq.moments(rng.normal(size=(4000, 6)) @ rng.normal(size=(6, 6)))
    assert gq.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    shifted = (a[0] + 0.1, a[1])
    assert gq.frechet_distance(a, shifted) == pytest.approx(6 * 0.01, rel=1e-6)
    # Symmetric, though the formula is not written symmetrically.
    b = gq.moments(rng.normal(size=(4000, 6)))
    assert gq.frechet_distance(a, b) == pytest.approx(gq.frechet_distance(b, a), rel=1e-6)


def test_the_steps_to_a_level_are_interpolated_between_evaluations():
    curve = [[100, 50.0], [200, 30.0], [300, 20.0], [400, 25.0]]
    assert gq.steps_to_reach(curve, 40.0) == pytest.approx(150.0)
    assert gq.steps_to_reach(curve, 20.0) == pytest.approx(300.0)
    assert gq.steps_to_reach(curve, 60.0) == 100.0  # already there at the first
    assert gq.steps_to_reach(curve, 10.0) is None
    # A curve that rose before it fell: the first crossing is taken at the point.
    assert gq.steps_to_reach([[100, 50.0], [200, 60.0], [300, 40.0]], 55.0) == 100.0


def test_the_steps_ratio_is_the_steps_taken_per_reference_step_to_the_same_quality():
    reference = [[100, 80.0], [200, 60.0], [300, 40.0], [400, 30.0]]
    assert gq.steps_ratio(reference, reference) == 1.0
    # A setting whose last two evaluations average 60 got there at step 350 (between
    # its 65 at 300 and 55 at 400); the reference at step 200.
    lossy = [[100, 90.0], [200, 75.0], [300, 65.0], [400, 55.0]]
    assert gq.final_quality(lossy) == pytest.approx(60.0)
    assert gq.steps_ratio(lossy, reference) == pytest.approx(1.75)
    # One better than the reference ever was: no ratio (reported as "< 1").
    assert gq.steps_ratio([[400, 10.0], [400, 10.0]], reference) is None


@pytest.mark.parametrize("argv, words", [
    (["--settings", "powersgd"], "--reference 'none' is not among --settings"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--steps", "100", "--eval_every", "200"], "--eval_every must be at most --steps"),
    (["--seeds", "0", "-1"], "--seeds must be at least 0"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--rate", "fast"], "--rate: link rate 'fast'"),
    (["--rate", "1gbps"], "use tc's syntax"),
])
def test_bad_arguments_stop_with_a_message(argv, words, capsys):
    with pytest.raises(SystemExit):
        gq.parse_args(argv)
    assert words in capsys.readouterr().err


def test_settings_and_seeds_given_twice_run_once():
    args = gq.parse_args(["--settings", "none", "qsgd", "none", "--seeds", "1", "0", "1"])
    assert args.settings == ["none", "qsgd"] and args.seeds == [1, 0]


def test_the_report_gives_each_seeds_final_quality_and_ratio_and_a_failed_run():
    reference = [[100, 80.0], [200, 60.0], [300, 40.0], [400, 30.0]]
    lossy = [[100, 90.0], [200, 75.0], [300, 65.0], [400, 55.0]]
    report = {"settings": ["none", "powersgd", "qsgd"], "reference": "none", "seeds": [0],
              "feature_accuracy": 0.87, "command": "c", "started": "s", "cpu_count": 2,
              "wall_s": 60, "complete": True, "workers": 2, "steps": 400, "eval_every": 100,
              "runs": [{"setting": "none", "seed": 0, "curve": reference},
                       {"setting": "powersgd", "seed": 0, "curve": lossy},
                       {"setting": "qsgd", "seed": 0, "curve": [], "failed": "boom"}]}
    text = gq.render(report)
    assert "| `none` | 35.0 | 1.00 |" in text
    assert "| `powersgd` | 60.0 | 1.75 |" in text
    assert "| `qsgd` | failed |  |" in text
    assert "| 200 | 60.0 | 75.0 |  |" in text  # the curves, step by step


def test_resume_keeps_the_runs_of_the_same_schedule_that_did_not_fail(tmp_path):
    out = str(tmp_path / "gq")
    gq._common.write_json(out + ".json", {
        "steps": 400, "eval_every": 100, "workers": 2,
        "runs": [{"setting": "none", "seed": 0, "curve": [[400, 30.0]]},
                 {"setting": "qsgd", "seed": 0, "curve": [], "failed": "boom"}]})
    args = gq.parse_args(["--settings", "none", "qsgd", "--steps", "400", "--eval_every",
                          "100", "--resume", "--out", out])
    assert [r["setting"] for r in gq._earlier(args)["runs"]] == ["none"]
    with pytest.raises(SystemExit, match="another schedule"):
        gq._earlier(gq.parse_args(["--steps", "800", "--resume", "--out", out]))
    assert gq._earlier(gq.parse_args(["--resume", "--out", out + "_none"])) is None


def test_the_seeds_mean_curve_and_the_references_levels_at_each_quarter():
    a = [[100, 80.0], [200, 60.0], [300, 40.0], [400, 30.0]]
    b = [[100, 60.0], [200, 40.0], [400, 10.0]]  # no evaluation at 300
    assert gq.mean_curve([a, b]) == [[100, 70.0], [200, 50.0], [400, 20.0]]
    assert gq.quarter_levels(a, 400) == [(100, 80.0), (200, 60.0), (300, 40.0), (400, 30.0)]
    # Evaluations sparser than quarters: each nearest one once.
    assert gq.quarter_levels([[200, 5.0], [400, 3.0]], 400) == [(200, 5.0), (400, 3.0)]
    report = {"settings": ["none", "lossy"], "reference": "none", "seeds": [0, 1],
              "feature_accuracy": 0.87, "command": "c", "started": "s", "cpu_count": 2,
              "wall_s": 60, "complete": True, "workers": 2, "steps": 400, "eval_every": 100,
              "runs": [{"setting": "none", "seed": 0, "curve": a},
                       {"setting": "none", "seed": 1, "curve": a},
                       {"setting": "lossy", "seed": 0, "curve": [[p[0], p[1] + 20.0] for p in a]},
                       {"setting": "lossy", "seed": 1, "curve": [[p[0], p[1] + 20.0] for p in a]}]}
    text = gq.render(report)
    # lossy's curve is none's a step of 100 later: to 60 at 300 (1.5x none's 200).
    assert "| 60.0 (200) | 200 (1.00) | 300 (1.50) |" in text
    assert "| 30.0 (400) | 400 (1.00) | not by 400 |" in text


def test_a_shaped_setting_is_named_with_its_rate_and_so_is_its_reference():
    assert gq.labelled("auto", None) == "auto"
    assert gq.labelled("auto", "1gbit") == "auto@1gbit"
    # A fresh sweep on a shaped link: the reference ran there too.
    args = gq.parse_args(["--settings", "none", "auto", "--rate", "1gbit"])
    assert gq.reference_of(args, None) == "none@1gbit"
    # Resumed: the reference may be the earlier sweep's (on loopback), not only one of
    # --settings; neither stops the sweep before anything is trained or built.
    args = gq.parse_args(["--settings", "auto", "--rate", "1gbit", "--resume"])
    assert (args.settings, args.rate, args.reference) == (["auto"], "1gbit", "none")
    assert gq.reference_of(args, {"settings": ["none", "powersgd"]}) == "none"
    with pytest.raises(SystemExit, match="neither among --settings nor in the resumed"):
        gq.reference_of(args, {"settings": ["powersgd"]})
    with pytest.raises(SystemExit, match="neither among --settings nor in the resumed"):
        gq.reference_of(args, None)


def test_the_report_gives_each_runs_median_step_where_it_was_timed():
    curve = [[100, 80.0], [200, 60.0]]
    report = {"settings": ["none", "auto", "auto@1gbit"], "reference": "none", "seeds": [0, 1],
              "feature_accuracy": 0.87, "command": "c", "started": "s", "cpu_count": 2,
              "wall_s": 60, "complete": True, "workers": 2, "steps": 200, "eval_every": 100,
              "runs": [{"setting": "none", "seed": 0, "curve": curve},  # before timing
                       {"setting": "auto", "seed": 0, "curve": curve},
                       {"setting": "auto@1gbit", "seed": 0, "curve": curve,
                        "median_step_ms": 71.26, "rate": "1gbit"},
                       {"setting": "auto@1gbit", "seed": 1, "curve": curve,
                        "median_step_ms": 80.0, "rate": "1gbit"}]}
    text = gq.render(report)
    assert "| `auto@1gbit` | 71.3 | 80.0 |" in text
    assert "`none` |" not in text.split("Median step")[1].split("FD at")[0]
    without = gq.render(dict(report, runs=report["runs"][:2], settings=["none", "auto"]))
    assert "Median step" not in without


def test_the_clock_at_a_step_is_interpolated_and_leaves_the_evaluations_out():
    # [step, FD, d_loss, g_loss, seconds since step 1, evaluations' seconds so far]
    curve = [[101, 80.0, 0, 0, 12.0, 2.0], [201, 60.0, 0, 0, 24.0, 4.0]]
    assert gq.clock_at(curve, 1) == 0.0
    assert gq.clock_at(curve, 51) == 5.0          # halfway to 10 s at step 101
    assert gq.clock_at(curve, 151) == 15.0        # between 10 and 20 s
    assert gq.clock_at(curve, 201) == 20.0
    assert gq.clock_at(curve, 202) is None         # past the curve's end
    # Runs from before the evaluations were counted: the clock as it is.
    assert gq.clock_at([[101, 80.0, 0, 0, 12.0]], 101) == 12.0
    # Runs from before the clock: none.
    assert gq.clock_at([[101, 80.0]], 101) is None


def test_the_time_to_quality_on_a_link_is_each_seeds_clock_at_the_mean_curves_step():
    def run(setting, seed, fds, seconds_a_step, rate=None, retrace=0.0):
        # Evaluations at steps 101, 201, 301, 401; 1 s of evaluation each; a retrace's
        # seconds after step 101 (not in the median step).
        curve = [[1 + 100 * k, fd, 0, 0, 100 * k * seconds_a_step + k
                  + (retrace if k > 1 else 0.0), float(k)]
                 for k, fd in zip((1, 2, 3, 4), fds)]
        return {"setting": setting, "seed": seed, "curve": curve, "rate": rate,
                "median_step_ms": 1e3 * seconds_a_step}

    ref0, ref1 = [80.0, 60.0, 40.0, 30.0], [100.0, 80.0, 60.0, 40.0]  # mean 90, 70, 50, 35
    report = {"settings": ["none", "auto@1gbit", "powersgd@1gbit", "auto@10gbit",
                           "qsgd@10gbit", "qsgd@100mbit"],
              "reference": "none", "seeds": [0, 1], "feature_accuracy": 0.87,
              "command": "c", "started": "s", "cpu_count": 2, "wall_s": 60,
              "complete": True, "workers": 2, "steps": 400, "eval_every": 100,
              "runs": [run("none", 0, ref0, 0.1), run("none", 1, ref1, 0.1),
                       # The reference's levels a step of 100 late, at 0.05 s a step.
                       run("auto@1gbit", 0, [100.0, 80.0, 60.0, 40.0], 0.05, "1gbit", 2.0),
                       run("auto@1gbit", 1, [120.0, 100.0, 80.0, 60.0], 0.05, "1gbit"),
                       # The reference's own curve at 0.1 s a step.
                       run("powersgd@1gbit", 0, ref0, 0.1, "1gbit"),
                       # Seed 1 has no clock: left out of the pairing, seed 0 alone.
                       dict(run("powersgd@1gbit", 1, ref1, 0.1, "1gbit"),
                            curve=[[101, 100.0], [201, 80.0], [301, 60.0], [401, 40.0]]),
                       run("auto@10gbit", 0, ref0, 0.02, "10gbit"),
                       run("auto@10gbit", 1, ref1, 0.03, "10gbit"),
                       run("qsgd@10gbit", 0, ref0, 0.04, "10gbit"),
                       run("qsgd@10gbit", 1, ref1, 0.04, "10gbit"),
                       run("qsgd@100mbit", 0, ref0, 0.5, "100mbit")]}
    text = gq.render(report)
    one = text.split("Time to quality on links shaped to 1gbit (seeds 0)")[1].split("\n\n")[1]
    ten = text.split("Time to quality on links shaped to 10gbit (seeds 0, 1)")[1].split(
        "\n\n")[1]
    # Seed 0 alone at 1 Gbit/s: the levels are none's seed-0 curve (80 at 101, 60 at
    # 201, 40 at 301, 30 at 401). auto reaches 80 at step 201 (200 steps of 0.05 s and
    # its 2 s retrace: 12 s), powersgd at 101 (10 s); 60 at 301 (17 s) and 201 (20 s).
    # auto never reaches 30.
    assert "| `auto@1gbit` | `powersgd@1gbit` |" in one and "10gbit" not in one
    assert "| 80.0 (101) | 12 (1.20) | 10 (1.00) |" in one
    assert "| 60.0 (201) | 17 (1.00) | 20 (1.18) |" in one
    assert "| 30.0 (401) | not by 401 | 40 (1.00) |" in one
    # Both seeds at 10 Gbit/s: the levels are the mean curve's (90, 70, 50, 35), both
    # settings reach 35 at step 401, auto on clocks of 8 and 12 s, qsgd of 16.
    assert "| `auto@10gbit` | `qsgd@10gbit` |" in ten and "1gbit`" not in ten
    assert "| 35.0 (401) | 10 (1.00) | 16 (1.60) |" in ten
    # A setting alone on its link: nothing to compare it with.
    assert "shaped to 100mbit" not in text
    # No level that none of them reaches divides by nothing.
    late = dict(report, runs=[
        dict(r, curve=[p[:1] + [500.0] + p[2:] for p in r["curve"]])
        if r["setting"] in ("auto@10gbit", "qsgd@10gbit") else r for r in report["runs"]])
    assert "| 35.0 (401) | not by 401 | not by 401 |" in gq.render(late)
