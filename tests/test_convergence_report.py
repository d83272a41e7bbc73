"""benchmarks/convergence.py's report: each setting judged against its own dense run."""

import pytest
import tensorflow as tf

from cluster_scripts import benchmark_module
from tfgc.compressors import ErrorFeedback, get as get_compressor

conv = benchmark_module("convergence")


def test_error_feedback_set_matches_the_compressors():
    # A compressor keeps what it did not send when its per-gradient state holds a
    # residual: the ef+ wrapper's and DGC's / PowerSGD's `residual`, variance-based's `r`.
    specs = [s["spec"] for s in conv.SETTINGS if s["spec"] != "stock"]
    specs += ["ef+qsgd", "onebit:momentum=0.9", " scaledsign", "randomk:ratio=0.1"]
    for spec in specs:
        c = get_compressor(spec.strip().format(steps_per_epoch=100))
        state = c.init_state(tf.TensorShape([64, 64]), tf.float32)
        keeps = isinstance(c, ErrorFeedback) or any(k in ("residual", "r") for k in state)
        assert keeps == conv.has_error_feedback(spec), spec
    assert not conv.has_error_feedback("stock")


def _run(model, label, accs, spec=None, optimizer="momentum", opt_m=0.9, comp_m=0.0):
    return {"model": model, "label": label, "spec": spec or label, "status": "ok",
            "optimizer": optimizer, "optimizer_momentum": opt_m, "compressor_momentum": comp_m,
            "final_accuracy": accs[-1] if accs else float("nan"),
            "curve": [{"test_accuracy": a} for a in accs]}


def _report(runs):
    return {"config": {"models": ["mlp", "cnn"]}, "runs": runs}


def _lines(report):
    table = "\n".join(conv.render_goal_table(report))
    return {row.split("|")[1].strip(): row for row in table.splitlines() if row.startswith("| ")}


def test_goal_rows_judge_each_setting_against_its_own_reference():
    sgd = dict(optimizer="sgd", opt_m=0.0)
    runs = [
        _run("mlp", "none", [0.70, 0.80, 0.84, 0.86]),
        _run("mlp", "none/sgd", [0.60, 0.70, 0.78, 0.80], spec="none", **sgd),
        # plain SGD, no momentum anywhere: against none/sgd
        _run("mlp", "ef+topk", [0.60, 0.70, 0.78, 0.798], spec="ef+topk:ratio=0.001", **sgd),
        # momentum on the workers, plain SGD in the optimizer: against none
        _run("mlp", "dgc", [0.70, 0.79, 0.83, 0.85], spec="dgc:ratio=0.001", comp_m=0.9, **sgd),
        _run("mlp", "qsgd", [0.70, 0.80, 0.84, 0.80]),
        # the momentum optimizer with momentum 0 is plain SGD: against none/sgd
        _run("mlp", "dgc:momentum=0", [0.6, 0.7, 0.8], optimizer="momentum", opt_m=0.0),
        _run("cnn", "none", [0.80, 0.85, 0.88, 0.90]),
        _run("cnn", "dgc", [0.80, 0.85, 0.88, 0.897], spec="dgc:ratio=0.001", comp_m=0.9, **sgd),
        dict(_run("cnn", "qsgd", [0.1]), status="failed"),
    ]
    rows = {label: (ef, per) for label, ef, per in conv.goal_rows(_report(runs))}
    assert list(rows) == ["none", "none/sgd", "ef+topk", "dgc", "qsgd", "dgc:momentum=0"]

    ef, per = rows["ef+topk"]
    assert ef and per["mlp"]["reference"] == "none/sgd" and per["cnn"] is None
    assert per["mlp"]["delta"] == pytest.approx(-0.2)
    assert per["mlp"]["tail"] == pytest.approx((0.70 + 0.78 + 0.798) / 3)
    assert per["mlp"]["tail_delta"] == pytest.approx(100 * (0.70 + 0.78 + 0.798 - 2.28) / 3)

    ef, per = rows["dgc"]
    assert ef and per["mlp"]["reference"] == per["cnn"]["reference"] == "none"
    assert per["mlp"]["delta"] == pytest.approx(-1.0)
    assert per["cnn"]["delta"] == pytest.approx(-0.3)
    assert not rows["qsgd"][0] and rows["qsgd"][1]["cnn"] is None
    assert rows["dgc:momentum=0"][1]["mlp"]["reference"] == "none/sgd"

    line = _lines(_report(runs))
    assert line["ef+topk"].rstrip(" |").endswith("met")
    assert "missed on mlp" in line["dgc"] and "cnn" not in line["dgc"].split("missed")[1]
    assert "(no error feedback)" in line["qsgd"]
    assert "none" not in line and "0.7980 (-0.20)" in line["ef+topk"]


def test_goal_is_never_met_without_a_reference():
    sgd = dict(optimizer="sgd", opt_m=0.0)
    runs = [
        _run("mlp", "none", [0.80, 0.86]),
        _run("mlp", "dgc", [0.80, 0.858], spec="dgc:ratio=0.001", comp_m=0.9, **sgd),
        dict(_run("cnn", "none", [0.9]), status="failed"),  # the reference failed
        _run("cnn", "dgc", [0.50, 0.60], spec="dgc:ratio=0.001", comp_m=0.9, **sgd),
        _run("cnn", "ef+topk", [0.5], spec="ef+topk:ratio=0.01", **sgd),  # none/sgd never ran
        # a raw spec as the label still counts as error feedback; an empty curve is no crash
        _run("mlp", "onebit:momentum=0.9", [], comp_m=0.9, **sgd),
    ]
    rows = {label: (ef, per) for label, ef, per in conv.goal_rows(_report(runs))}
    assert rows["dgc"][1]["cnn"]["delta"] is None
    assert conv.goal_verdict(*rows["dgc"]) == "met on mlp; cnn: no reference"
    assert conv.goal_verdict(*rows["ef+topk"]) == "cnn: no reference"
    assert rows["onebit:momentum=0.9"][0]
    line = _lines(_report(runs))
    assert "| – | – |" in line["onebit:momentum=0.9"]  # NaN final and tail shown as –
    assert conv.goal_verdict(True, {"mlp": {"delta": -0.6}, "cnn": None}) == "missed on mlp"
    assert conv.goal_verdict(True, {"mlp": {"delta": -0.5}}) == "met"
