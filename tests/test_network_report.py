"""benchmarks/network.py's rounds (``--repeats``) and what its report makes of them (the
sweep itself needs root and a shaped cluster: the benchmark, not the suite)."""

import pytest

from cluster_scripts import benchmark_module

network = benchmark_module("network")
report = benchmark_module("network_report")


def _args(*argv):
    return network.parse_args(["--models", "mlp", "--rates", "1gbit", "100mbit",
                               "--workers", "2", "--bytes_workers", "--configs", "qsgd",
                               "auto", *argv])


def test_rounds_run_every_configuration_once_a_round_at_each_rate():
    runs = network.plan_runs(_args("--repeats", "3"))
    order = [(r["rate"], r["round"], r["config"]) for r in runs]
    configs = ["stock", "qsgd", "auto"]
    assert order == [(rate, k, c) for rate in ("1gbit", "100mbit") for k in range(3)
                     for c in configs]
    # One round: the runs carry no round, as before rounds existed.
    assert all("round" not in r for r in network.plan_runs(_args()))


def test_bad_repeats_stop_with_a_message(capsys):
    with pytest.raises(SystemExit):
        _args("--repeats", "0")
    assert "--repeats must be at least 1" in capsys.readouterr().err


def _run(config, rate, ms, round_=None, status="ok"):
    run = {"kind": "main", "model": "m", "workers": 2, "config": config, "rate": rate,
           "status": status, "median_ms": ms, "veth_tx_per_step_max": 1e6}
    if round_ is not None:
        run["round"] = round_
    return run


def _rounds(steps):
    """Runs from {config: [ms per round]} at 100 Mbit/s, plus stock at 10 Gbit/s (the
    floor) for each configuration."""
    runs = []
    for k in range(len(next(iter(steps.values())))):
        for config, ms in steps.items():
            runs.append(_run(config, "10gbit", 50.0, k))
            runs.append(_run(config, "100mbit", ms[k], k, "failed" if ms[k] is None else "ok"))
    return runs


def test_speedups_are_taken_within_a_round_and_combined_as_their_median():
    # The machine slowed down in the last round: stock and qsgd both took twice as long.
    runs = _rounds({"stock": [400.0, 410.0, 800.0], "qsgd@auto": [100.0, 205.0, 200.0]})
    report.add_speedups(runs)
    assert [r["speedup"] for r in runs if r["config"] == "qsgd@auto"
            and r["rate"] == "100mbit"] == pytest.approx([4.0, 2.0, 4.0])
    combined = report.combine_rounds(runs)
    qsgd = next(r for r in combined if r["config"] == "qsgd@auto" and r["rate"] == "100mbit")
    assert qsgd["median_ms"] == 200.0 and qsgd["rounds_ms"] == [100.0, 205.0, 200.0]
    # The median of the rounds' own speed-ups, not of the medians' quotient (410 / 200).
    assert qsgd["speedup"] == pytest.approx(4.0)
    assert qsgd["round"] == 2  # the round whose step is the median stands for them
    # The overlap figures come from the combined steps: the floor is the 10 Gbit/s one.
    assert qsgd["floor_ms"] == 50.0 and qsgd["vs_max"] == pytest.approx(200.0 / 80.0)
    assert len(combined) == 4


def test_a_failed_round_is_left_out_of_the_median_and_shown():
    runs = _rounds({"stock": [400.0, 400.0, 400.0], "qsgd@auto": [100.0, None, 300.0]})
    report.add_speedups(runs)
    qsgd = next(r for r in report.combine_rounds(runs)
                if r["config"] == "qsgd@auto" and r["rate"] == "100mbit")
    assert qsgd["status"] == "ok" and qsgd["median_ms"] == 200.0
    assert qsgd["rounds_ms"] == [100.0, "failed", 300.0]
    # A round cut short (no status): not run, not failed.
    del runs[-1]["status"]
    qsgd = next(r for r in report.combine_rounds(runs)
                if r["config"] == "qsgd@auto" and r["rate"] == "100mbit")
    assert qsgd["rounds_ms"] == [100.0, "failed", None] and qsgd["median_ms"] == 100.0
    # Failed in every round: the first failure stands for them.
    runs = _rounds({"stock": [400.0, 400.0], "qsgd@auto": [None, None]})
    failed = [r for r in report.combine_rounds(runs) if r["config"] == "qsgd@auto"
              and r["rate"] == "100mbit"]
    assert len(failed) == 1 and failed[0]["status"] == "failed" and failed[0]["round"] == 0


def test_auto_is_set_against_each_rounds_fastest_fixed_setting():
    # Round 1: qsgd fastest (auto 1.2x it); round 2: powersgd (auto 1.0x); round 3:
    # qsgd (auto 1.1x). Against the median's fastest alone, round 2 would read 0.75.
    runs = _rounds({"stock": [900.0] * 3, "qsgd@auto": [100.0, 200.0, 100.0],
                    "powersgd@auto": [150.0, 150.0, 180.0],
                    "auto@auto": [120.0, 150.0, 110.0]})
    (row,) = [r for r in report.auto_against_fixed(runs) if r[2] == "100mbit"]
    model, n, rate, config, fastest, ratio = row
    assert (model, n, config, fastest) == ("m", 2, "auto@auto", "qsgd@auto")
    assert ratio == pytest.approx(1.1)
    # A round in which a setting failed is left out rather than set against a slower
    # one: round 2 (qsgd failed) would read 150 / 300 = 0.5. The median of rounds 1 and
    # 3, 1.2 and 1.1.
    runs = _rounds({"stock": [900.0] * 3, "qsgd@auto": [100.0, None, 100.0],
                    "powersgd@auto": [300.0, 300.0, 300.0],
                    "auto@auto": [120.0, 150.0, 110.0]})
    (row,) = [r for r in report.auto_against_fixed(runs) if r[2] == "100mbit"]
    assert row[4] == "qsgd@auto" and row[5] == pytest.approx(1.15)
    # Without rounds: the one ratio.
    single = [dict(r) for r in runs if r["round"] == 0]
    for r in single:
        del r["round"]
    assert [r[5] for r in report.auto_against_fixed(single)
            if r[2] == "100mbit"] == pytest.approx([1.2])


def test_the_report_gives_the_rounds_median_each_round_and_autos_ratio():
    args = _args("--repeats", "3", "--configs", "qsgd", "auto", "--rates", "100mbit")
    runs = _rounds({"stock": [400.0, 410.0, 800.0], "qsgd": [100.0, 205.0, 200.0],
                    "auto": [110.0, 190.0, 260.0]})
    runs = [r for r in runs if r["rate"] == "100mbit"]
    for r in runs:
        r.update(veth_tx_per_step=1e6, strategy_sent_per_step=1e6, dense_sent_per_step=4e6,
                 params=10, dense_bytes=40, dataset="synthetic", other_cpu_cores=0.0)
    report.add_speedups(runs)
    text = report.render_markdown({"runs": runs, "command": "c", "started": "s",
                                   "cpu_count": 2, "complete": True, "wall_s": 60,
                                   "link": "l", "auto_settle": {"steps": 1, "every": 1}},
                                  args)
    assert "the median of 3 rounds'" in text
    assert "| `qsgd` | 200 |" in text  # the rounds' median step
    # Rounds: auto 1.10, 0.93 and 1.30 times qsgd: the median 1.10.
    assert "| `auto` | m | 2 | 100 Mbit/s | `qsgd` | 1.10 |" in text
    assert "| `auto` | m | 2 | 100 Mbit/s | 110, 190, 260 |" in text


def test_the_report_says_when_the_settle_went_back_to_a_plan_that_ran_faster():
    args = _args("--configs", "auto", "--rates", "100mbit", "--auto_plan", "settled")
    runs = [r for r in _rounds({"stock": [400.0], "auto": [110.0]}) if r["rate"] == "100mbit"]
    for r in runs:
        r.update(veth_tx_per_step=1e6, strategy_sent_per_step=1e6, dense_sent_per_step=4e6,
                 params=10, dense_bytes=40, dataset="synthetic", other_cpu_cores=0.0)
    (auto,) = [r for r in runs if r["config"] == "auto"]
    auto.update(plan=["a=rqsgd4@allgather", "b=fp32@allreduce"], plan_figures="f",
                plan_pace=[0.05, 0.9, 0.3, 0.0])
    report.add_speedups(runs)
    texts = {}
    for back in (None, 0, 1, 2):
        auto["auto_went_back"] = back
        texts[back] = report.render_markdown(
            {"runs": runs, "command": "c", "started": "s", "cpu_count": 2, "complete": True,
             "wall_s": 60, "link": "l", "auto_settle": {"steps": 25, "every": 8}}, args)
        assert "fp32 x1, rqsgd4 x1" in texts[back]
    assert "went back" not in texts[None] and "went back" not in texts[0]
    assert "went back 1 time to a plan" in texts[1]
    assert "went back 2 times to a plan" in texts[2]


def test_pins_must_be_candidates_and_need_an_auto_configuration(capsys):
    assert _args("--auto_pins", "bf16", "own").auto_pins == ["bf16", "own"]
    with pytest.raises(SystemExit):
        _args("--auto_pins", "bf17")
    assert "--auto_pins: bf17 not among" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        network.parse_args(["--configs", "qsgd", "--auto_pins", "bf16"])
    assert "needs an auto configuration" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--auto_pins", "bf16", "--warmup", "0")
    assert "--auto_pins needs --warmup of at least 1" in capsys.readouterr().err


def test_the_pin_labels_are_the_planner_s():
    from tfgc.distribute import planner  # the driver lists them without TensorFlow

    assert network.PIN_LABELS == tuple(planner.BY_LABEL)


def _pin(label, pass_, step, predicted):
    return {"pin": label, "pass": pass_, "median_ms": step, "predicted_ms": predicted,
            "labels": {label: 3}, "more_steps": 0.25 if label == "topk1" else 0.0}


def test_pinned_plans_are_set_against_their_predictions_pair_by_pair():
    # Steps of 50 ms compute plus the predicted communication, except rqsgd4's, which
    # ran 20 ms slower than predicted: predicted 10 ms below bf16's, it ran 10 ms
    # above it, out of order.
    rows = [_pin("bf16", 0, 80.0, 30.0), _pin("bf16", 1, 80.0, 30.0),
            _pin("rqsgd4", 0, 90.0, 20.0), _pin("rqsgd4", 1, 90.0, 20.0)]
    table, counts = report.pin_summary(rows)
    assert counts == {"order": 0, "close": 0, "out": 1}
    assert [t["rest"] for t in table] == [50.0, 70.0]
    # topk1's passes (60 and 90 ms) overlap bf16's and rqsgd4's: too close to order.
    # psgd2 (55-56 ms) is clear of every other range: ordered against bf16 and
    # rqsgd4, and too close to topk1, whose prediction is the same.
    rows += [_pin("topk1", 0, 60.0, 5.0), _pin("topk1", 1, 90.0, 5.0),
             _pin("psgd2", 0, 55.0, 5.0), _pin("psgd2", 1, 56.0, 5.0)]
    table, counts = report.pin_summary(rows)
    assert counts == {"order": 2, "close": 3, "out": 1}
    assert next(t for t in table if t["pin"] == "topk1")["step"] == 75.0
    # A fit with no timed step is left out.
    table, counts = report.pin_summary(rows + [_pin("qsgd8", 0, float("nan"), 1.0)])
    assert "qsgd8" not in {t["pin"] for t in table} and sum(counts.values()) == 6
    text = "\n".join(report.render_pins([{**_run("auto", "1gbit", 80.0), "pins": rows}]))
    assert "| `bf16` | 80.0, 80.0 | 80.0 | 30.0 | 50.0 | 0% | bf16 x3 |" in text
    assert "| `topk1` | 60.0, 90.0 | 75.0 | 5.0 | 70.0 | 25% | topk1 x3 |" in text
    assert ("Of the 6 pairs of plans, the predictions order 2 as their steps ran and 1 "
            "the other way; in 3") in text and "from 50.0 to 70.0 ms" in text
    assert report.render_pins([_run("auto", "1gbit", 80.0)]) == []
    # Per lossless step: topk1 75 x 1.25 = 93.75 ms; psgd2 55.5, the fastest; own 61 ms
    # with 10 % more steps, 67.1 ms, 1.21x it. Without own, no sentence.
    assert "Per step of a lossless plan" not in text
    own = [dict(_pin("own", k, 61.0, 10.0), more_steps=0.1) for k in (0, 1)]
    text = "\n".join(report.render_pins([{**_run("auto", "1gbit", 80.0), "pins": rows + own}]))
    assert ("`own` 67.1 ms, 1.21x the fastest label pinned everywhere, `psgd2` (55.5 ms)"
            in text)


def test_pinned_steps_time_each_label_and_the_run_s_own_plan_in_two_passes():
    # The worker's pin phase on one worker in this process: every label in both
    # passes (own last in the second), own pinned as the plan the run timed, one row
    # per fit with a finite step and a prediction, saved after each, and the choice
    # given back at the end.
    import argparse

    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    import tfgc

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    with strategy.scope():
        net = keras.Sequential([keras.layers.Dense(64, input_shape=(40,), name="a"),
                                keras.layers.Dense(4, name="b")])
        net.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(64, 40)).astype(np.float32),
         rng.normal(size=(64, 4)).astype(np.float32))).batch(8).repeat()
    net.fit(data, steps_per_epoch=2, verbose=0)
    timed = {e.name: e.label for e in strategy.compression_plan().entries}
    args = argparse.Namespace(auto_pins=["own", "bf16", "psgd2"], warmup=1, steps=2)
    rows, saved = [], []
    network._pinned_steps(strategy, net, data, args, keras, rows,
                          lambda: saved.append(len(rows)))
    assert [(r["pin"], r["pass"]) for r in rows] == [
        ("own", 0), ("bf16", 0), ("psgd2", 0), ("psgd2", 1), ("bf16", 1), ("own", 1)]
    assert saved == [1, 2, 3, 4, 5, 6]
    assert all(len(r["durations_ms"]) == 2 and np.isfinite(r["median_ms"])
               and r["predicted_ms"] >= 0 for r in rows)
    assert [r["labels"] for r in rows[:3]] == [
        {label: 1 for label in timed.values()}, {"bf16": 1}, {"psgd2": 1}]
    assert rows[-1]["labels"] == rows[0]["labels"]
    # Given back: the planner's choice, nothing pinned.
    assert not any(e.reason.startswith("pinned")
                   for e in strategy.compression_plan().entries)


def test_the_workers_log_what_they_are_told_to():
    # --worker_log reaches each worker's command line, which parses it back, and sets
    # absl's verbosity there: at 'info' a worker's log keeps auto's reasons for keeping
    # or changing its plan, which the default leaves out.
    from absl import logging as absl_logging

    run = network.plan_runs(_args())[0]
    for level, verbosity in (("info", absl_logging.INFO), ("warning", absl_logging.WARNING)):
        args = _args() if level == "warning" else _args("--worker_log", level)
        cmd = network.worker_command(run, args, "/tmp/x/result", 2)
        worker = network.parse_args(cmd[2:])
        assert worker.worker and worker.worker_log == level
        before = absl_logging.get_verbosity()
        try:
            network.set_worker_log(worker.worker_log)
            assert absl_logging.get_verbosity() == verbosity
        finally:
            absl_logging.set_verbosity(before)
    with pytest.raises(SystemExit):
        _args("--worker_log", "debug")


def test_the_shaped_cluster_finds_tc_where_path_leaves_out_the_system_directories(
        tmp_path, monkeypatch):
    netns = benchmark_module("netns")
    system = tmp_path / "sbin"
    system.mkdir()
    tc = system / "tc"
    tc.write_text("#!/bin/sh\n")
    tc.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(netns, "SYSTEM_DIRS", (str(system),))
    assert netns.tool("tc") == str(tc)
    assert netns.tool("ip") is None
    tc.chmod(0o644)  # not executable: not a tool
    assert netns.tool("tc") is None
