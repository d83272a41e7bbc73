"""Recommended settings (tfgc.compressors.recommended) and how the trainer uses them."""

import subprocess
import sys

import numpy as np
import pytest

from tfgc.apps import train
from tfgc.compressors import get, names, recommended, recommended_settings
from tfgc.compressors.recommended import Recommendation, needs_steps_per_epoch, resolve


def test_every_registry_name_has_a_setting_that_builds():
    table = {r.name for r in recommended_settings()}
    assert table == set(names())
    for rec in recommended_settings():
        spec = rec.spec(117)
        assert "{" not in spec
        compressor = get(spec)  # parses and builds
        assert rec.optimizer in ("momentum", "sgd")
        # Momentum applied on the workers never meets momentum in the optimizer.
        if compressor.applied_momentum:
            assert rec.optimizer == "sgd", rec
        assert rec.source


def test_lookup_by_name_or_string():
    assert recommended("dgc").name == "dgc"
    assert recommended("dgc:ratio=0.01").name == "dgc"
    assert recommended("  DGC ").name == "dgc"
    assert recommended("ef+topk:ratio=0.01").name == "ef"
    assert recommended("ef+randomk").name == "randomk"
    assert recommended("efsignsgd").name == "efsignsgd"
    with pytest.raises(ValueError, match="did you mean 'dgc'"):
        recommended("dgcc")
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="`name`"):
            recommended(bad)


def test_spec_fills_in_the_steps_per_epoch():
    dgc = recommended("dgc")
    assert dgc.needs_steps_per_epoch
    assert dgc.spec(234) == "dgc:ratio=0.001,warmup_steps=234"
    assert get(dgc.spec(234)).warmup_steps == 234
    for bad in (None, 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="steps_per_epoch"):
            dgc.spec(bad)
    assert not recommended("qsgd").needs_steps_per_epoch
    assert recommended("qsgd").spec() == "qsgd:levels=127,bucket_size=512"


def test_resolve_takes_the_recommended_string_only_for_a_bare_name():
    assert resolve("dgc", 50) == "dgc:ratio=0.001,warmup_steps=50"
    assert resolve("dgc") == "dgc:ratio=0.001,warmup_steps={steps_per_epoch}"
    assert resolve("randomk") == "ef+randomk:ratio=0.01"  # memory is the recommendation
    assert resolve("onebit") == "onebit:momentum=0.9"
    assert resolve("ef") == resolve("ef+topk") == recommended("ef").spec()
    # Hyperparameters, or another composition, are the user's choice.
    assert resolve("dgc:ratio=0.01") == "dgc:ratio=0.01"
    assert resolve("ef+qsgd") == "ef+qsgd"


def test_learning_rate_and_description():
    sign = recommended("signsgd")
    assert sign.learning_rate(0.05) == pytest.approx(0.002)
    assert recommended("none").learning_rate(0.05) == 0.05
    with pytest.raises(ValueError, match="dense_learning_rate"):
        sign.learning_rate(0)
    text = recommended("dgc").describe(10)
    assert text.startswith("dgc:ratio=0.001,warmup_steps=10, plain SGD")
    assert "1-epoch warm-up, then cosine" in text
    assert "0.04 x the dense rate" in sign.describe()
    # The string a run trained with stands in for the setting's own.
    assert sign.describe(compressor="signsgd:seed=3").startswith("signsgd:seed=3, plain SGD")


def test_epochs_scale_lengthens_only_the_settings_that_need_it():
    # The casts and 8-bit QSGD keep dense's schedule; error feedback trains twice as long.
    for name in ("none", "bf16", "qsgd"):
        assert recommended(name).epochs(5) == 5
        assert "epochs" not in recommended(name).describe()
    ef = recommended("ef")
    assert ef.epochs_scale == 2 and ef.epochs(5) == 10
    assert ef.describe().endswith(", 2 x the dense run's epochs")
    assert Recommendation(name="x", compressor="none", optimizer="sgd",
                          epochs_scale=1.5).epochs(3) == 4  # rounded, never fewer
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="dense_epochs"):
            ef.epochs(bad)


@pytest.mark.parametrize("field, value", [
    ("optimizer", "adam"), ("schedule", "linear"), ("lr_scale", 0.0), ("warmup_epochs", -1),
    ("epochs_scale", 0.5), ("epochs_scale", True)])
def test_a_bad_recommendation_fails_at_construction(field, value):
    kwargs = dict(name="x", compressor="none", optimizer="sgd")
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"`{field}`"):
        Recommendation(**kwargs)


# The trainer.

def test_training_setting_without_recommended_is_what_was_given():
    s = train.training_setting("dgc", optimizer="momentum", learning_rate=0.1)
    assert (s["compressor"], s["optimizer"], s["learning_rate"], s["schedule"]) == \
        ("dgc", "momentum", 0.1, "constant")
    assert s["recommendation"] is None


def test_training_setting_fills_in_what_the_user_left_out():
    s = train.training_setting("signsgd", recommended=True, learning_rate=0.05)
    assert (s["compressor"], s["optimizer"], s["schedule"], s["warmup_epochs"]) == \
        ("signsgd", "sgd", "cosine", 1.0)
    assert s["learning_rate"] == pytest.approx(0.002)
    # Flags the user gave win.
    s = train.training_setting("signsgd", recommended=True, optimizer="momentum",
                               schedule="constant", warmup_epochs=0.0,
                               given={"optimizer", "schedule", "warmup_epochs"})
    assert (s["optimizer"], s["schedule"], s["warmup_epochs"]) == ("momentum", "constant", 0)
    # The stock strategy trains at the dense setting.
    s = train.training_setting("dgc", baseline=True, recommended=True)
    assert (s["optimizer"], s["learning_rate"]) == ("momentum", 0.05)
    # A string that needs the steps per epoch says so; the caller fills it in.
    s = train.training_setting("dgc", recommended=True)
    assert needs_steps_per_epoch(s["compressor"])
    assert s["recommendation"].spec(7).endswith("warmup_steps=7")
    s = train.training_setting("dgc:ratio=0.01", recommended=True)
    assert not needs_steps_per_epoch(s["compressor"]) and s["compressor"] == "dgc:ratio=0.01"
    # --epochs is the dense run's: scaled, unless the user gave it.
    assert train.training_setting("ef", recommended=True, epochs=3)["epochs"] == 6
    assert train.training_setting("ef", recommended=True, epochs=3,
                                  given={"epochs"})["epochs"] == 3
    assert train.training_setting("qsgd", recommended=True, epochs=3)["epochs"] == 3
    assert train.training_setting("ef", baseline=True, recommended=True,
                                  epochs=3)["epochs"] == 3
    assert train.training_setting("ef", epochs=3)["epochs"] == 3


def test_steps_per_epoch_for():
    assert train.steps_per_epoch_for(60000, 4, 64) == 234
    assert train.steps_per_epoch_for(60000, 4, 64, cap=10) == 10
    with pytest.raises(ValueError, match="batch_size 64 is larger"):
        train.steps_per_epoch_for(100, 4, 64)


def test_cosine_schedule_warms_up_then_decays_to_zero():
    lr = train.make_learning_rate(0.1, warmup_steps=10, schedule="cosine", total_steps=110)
    values = np.array([float(lr(t)) for t in range(111)])
    assert values[0] == pytest.approx(0.01)  # a tenth of the rate
    assert values[10] == pytest.approx(0.1)
    assert np.all(np.diff(values[:11]) > 0) and np.all(np.diff(values[10:]) < 1e-9)
    assert values[60] == pytest.approx(0.05, rel=1e-5)  # half-way down the half cosine
    assert values[110] == pytest.approx(0.0, abs=1e-7)
    # With linear scaling the warm-up starts at the one-worker rate and peaks at N x.
    lr = train.make_learning_rate(0.1, "linear", workers=4, warmup_steps=10,
                                  schedule="cosine", total_steps=20)
    assert float(lr(0)) == pytest.approx(0.1) and float(lr(10)) == pytest.approx(0.4)
    lr = train.make_learning_rate(0.1, schedule="cosine", total_steps=20)
    assert float(lr(0)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="total_steps"):
        train.make_learning_rate(0.1, warmup_steps=10, schedule="cosine", total_steps=10)
    with pytest.raises(ValueError, match="`schedule`"):
        train.make_learning_rate(0.1, schedule="step")
    assert train.cosine_warmup_steps(234, 234) == 58
    assert train.cosine_warmup_steps(234, 2340) == 234


def test_trainer_recommended_flag_one_worker(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tfgc.apps.train", "--compressor=dgc", "--recommended",
         "--dataset=mnist5k", "--epochs=2", "--steps_per_epoch=8", f"--json_out={out}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json
    results = json.loads(out.read_text())
    assert results["compressor"] == "dgc:ratio=0.001,warmup_steps=8"
    assert (results["optimizer"], results["schedule"], results["warmup_steps"]) == \
        ("sgd", "cosine", 4)  # a quarter of the 16 steps: the one-epoch warm-up capped
    assert results["recommended"].startswith("dgc:ratio=0.001,warmup_steps=8, plain SGD")
    assert "setting        recommended: dgc:ratio=0.001,warmup_steps=8" in proc.stdout



def test_trainer_recommended_flag_refuses_an_unknown_compressor_in_one_line():
    # Checked before any worker starts: one line naming the flag, no traceback.
    proc = subprocess.run(
        [sys.executable, "-m", "tfgc.apps.train", "--compressor=dgcc", "--recommended",
         "--workers=2", "--dataset=mnist5k", "--epochs=1"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("tfgc-train: --recommended: no recommended setting for "
                                "'dgcc' (did you mean 'dgc'?)"), proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr
