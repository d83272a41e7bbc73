"""The trainer's pieces that need no cluster: users' entry points, how compressors are
named, which of TensorFlow's lines a local run hides, and the progress bar."""

import io
import sys

import numpy as np
import pytest
import tf_keras as keras

from tfgc.apps import data as data_lib
from tfgc.apps import entry_points, models
from tfgc.compressors import describe, get, serialize
from tfgc.apps.train import make_progress, shown_line


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``my_task`` in a fresh directory that is the current directory."""
    (tmp_path / "my_task.py").write_text('''
import numpy as np
import tf_keras as keras

CONSTANT = 3

def build(input_shape, num_classes, seed):
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential([keras.Input(input_shape),
                             keras.layers.Dense(num_classes, kernel_initializer=init)])

def build_softmax(input_shape, num_classes):
    return keras.Sequential([keras.Input(input_shape),
                             keras.layers.Dense(num_classes, activation="softmax")])

def build_other():
    return "not a model"

def load(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (50, 4, 4, 3), dtype=np.uint8)
    return (x, rng.integers(0, 5, (50, 1))), (x[:10], rng.integers(0, 4, 10))

def load_no_seed():
    return data_kept

def load_bad():
    return [1, 2, 3]

def load_mismatch():
    return (np.zeros((4, 2), np.float32), np.zeros(3, int)), (np.zeros((2, 2)), np.zeros(2, int))

def load_float_labels():
    return (np.zeros((4, 2)), np.zeros(4)), (np.zeros((2, 2)), np.zeros(2, int))
''')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    sys.modules.pop("my_task", None)


def test_entry_point_form():
    assert entry_points.is_entry_point("pkg.mod:fn")
    assert entry_points.is_entry_point("mod:obj.fn")
    for bad in ("mlp", "pkg.mod", "pkg.mod:", ":fn", "a b:c", "pkg/mod:fn", 3, None):
        assert not entry_points.is_entry_point(bad)


def test_user_model_built_from_the_current_directory(user_module):
    net = models.build_model("my_task:build", input_shape=(6,), num_classes=4, seed=3)
    assert isinstance(net, keras.Model) and net.output_shape == (None, 4)
    again = models.build_model("my_task:build", input_shape=(6,), num_classes=4, seed=3)
    for a, b in zip(net.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(a, b)  # the seed reaches the user's initializers
    assert not entry_points.outputs_probabilities(net)
    # A function may take only some of the arguments, by name.
    soft = models.build_model("my_task:build_softmax", input_shape=(6,), num_classes=2)
    assert entry_points.outputs_probabilities(soft)


def test_user_model_errors_name_the_flag(user_module):
    with pytest.raises(ValueError, match=r"--model='my_task:nothing'.*no attribute 'nothing'"):
        models.build_model("my_task:nothing")
    with pytest.raises(ValueError, match=r"no module named 'nowhere'"):
        models.build_model("nowhere:build")
    with pytest.raises(ValueError, match=r"'CONSTANT' is a int, not a function"):
        models.build_model("my_task:CONSTANT")
    with pytest.raises(TypeError, match=r"returned a builtins.str, not a tf_keras.Model"):
        models.build_model("my_task:build_other")
    with pytest.raises(ValueError, match=r"or package.module:build_fn"):
        models.build_model("resnet")


def test_module_exists_finds_without_importing(user_module):
    import sys
    sys.modules.pop("my_task", None)
    assert entry_points.module_exists("my_task:build")  # the current directory
    assert "my_task" not in sys.modules  # located, not imported
    assert entry_points.module_exists("tfgc.apps.models:build_model")
    assert not entry_points.module_exists("nowhere:build")
    assert not entry_points.module_exists("nowhere.sub:build")  # missing parent package
    pkg = user_module / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text("raise RuntimeError('imported')\n")
    sys.modules.pop("my_pkg", None)
    assert entry_points.module_exists("my_pkg.nets:build")  # found, not run
    assert "my_pkg.nets" not in sys.modules
    assert not entry_points.module_exists("my_pkg.other:build")


def test_user_dataset_from_keras_style_tuples(user_module):
    ds = data_lib.load_dataset("my_task:load", seed=1)
    assert ds.name == "my_task:load"
    assert ds.x_train.dtype == np.float32 and ds.x_train.shape == (50, 4, 4, 3)
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0  # uint8 scaled to [0, 1]
    assert ds.y_train.shape == (50,) and ds.y_train.dtype == np.int32  # [n, 1] flattened
    assert ds.num_classes == max(ds.y_train.max(), ds.y_test.max()) + 1
    again = data_lib.load_dataset("my_task:load", seed=1)
    np.testing.assert_array_equal(ds.y_train, again.y_train)  # the seed is passed on


@pytest.mark.parametrize("spec, error, match", [
    ("my_task:load_bad", TypeError, r"must return a tfgc.apps.data.Dataset or"),
    ("my_task:load_mismatch", ValueError, r"4 train examples but 3 labels"),
    ("my_task:load_float_labels", ValueError, r"y_train must be integer class ids"),
    ("my_task:load_no_seed", NameError, r"data_kept"),
])
def test_user_dataset_errors(user_module, spec, error, match):
    with pytest.raises(error, match=match):
        data_lib.load_dataset(spec)


def test_describe_is_short_and_round_trips():
    cases = {"ef+topk:ratio=0.001": "ef+topk:ratio=0.001", "onebit": "onebit",
             "onebit:momentum=0.9": "onebit:momentum=0.9", "dgc": "dgc",
             "qsgd:levels=7,bucket_size=128": "qsgd:bucket_size=128,levels=7", "none": "none",
             "powersgd:rank=4": "powersgd:rank=4", "topk": "topk"}
    for spec, short in cases.items():
        compressor = get(spec)
        assert describe(compressor) == short
        assert get(describe(compressor)) == compressor
    assert serialize(get("ef+topk:ratio=0.001")) == "ef+topk:k=0,ratio=0.001"


def test_tensorflow_start_up_lines_are_hidden_and_the_rest_shown():
    hidden = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        "I0000 00:00:1795502434.970564    3819 cudart_stub.cc:31] Could not find cuda drivers\n",
        "W0000 00:00:1795502444.494305    3819 dataset.cc:997] Input of GeneratorDatasetOp\n",
        "I1124 06:40:44.632533 140247260810112 cross_device_ops.py:1154] Collective all_reduce "
        "tensors: 6 all_reduces\n",
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild\n",
        "E0000 00:00:1795502439.139511    3819 cuda_platform.cc:52] failed call to cuInit: "
        "INTERNAL\n",
    ]
    shown = [
        "epoch 1/2 [#####...] 5/23  2s  sent 0.9 kB/step\n",
        "E0000 00:00:1795502439.139511    3819 collective_ops.cc:1] Collective failed\n",
        "Traceback (most recent call last):\n",
        "I think this is fine\n",
        "RESULT {}\n",
    ]
    assert not any(shown_line(line) for line in hidden)
    assert all(shown_line(line) for line in shown)


def test_progress_bar_draws_tenths_and_epoch_figures():
    out = io.StringIO()
    progress = make_progress(epochs=2, steps=20, stream=out)
    for epoch in range(2):
        progress.on_epoch_begin(epoch)
        for batch in range(20):
            progress.on_train_batch_end(batch, {"loss": 2.0, "accuracy": 1.5, "sent_MB": 0.02})
        progress.on_epoch_end(epoch, {"loss": 0.5, "accuracy": 0.75, "sent_MB": 0.02})
    lines = out.getvalue().splitlines()
    assert len(lines) == 20  # nine tenths and the end, per epoch
    assert lines[0].startswith("epoch 1/2 [##") and " 2/20 " in lines[0]
    assert lines[9].startswith("epoch 1/2 [" + "#" * 24 + "] 20/20")
    # Per-batch loss and accuracy are not shown (tf-keras adds up the workers' figures
    # there); the epoch's are.
    assert "loss" not in lines[0] and "loss 0.5  accuracy 0.75" in lines[9]
    assert all("sent 20.0 kB/step" in line for line in lines)
    assert lines[10].startswith("epoch 2/2")


def _trainer(*flags, timeout=120):
    import os
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", "from tfgc.apps.train import run; run()", *flags],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_help_lists_the_trainers_own_flags_and_exits_0():
    proc = _trainer("--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--compressor", "--workers", "--optimizer", "--communication", "--[no]tf_logs"):
        assert flag in proc.stdout
    assert "--helpfull" in proc.stdout
    assert "--alsologtostderr" not in proc.stdout  # absl's own flags stay out


@pytest.mark.parametrize("flags, words", [
    (["--compressor=tpok:ratio=0.01"], ["--compressor='tpok:ratio=0.01'", "did you mean 'topk'"]),
    (["--compressor=topk:ratoi=0.01"], ["no hyperparameter `ratoi`", "did you mean 'ratio'"]),
    (["--compressor=qsgd", "--communication=low_rank"], ["--communication=low_rank", "powersgd"]),
])
def test_a_bad_compressor_stops_before_any_worker_starts(flags, words):
    proc = _trainer("--workers=2", "--timeout=60", *flags)
    assert proc.returncode == 1
    message = proc.stderr.strip().splitlines()
    assert len(message) == 1, proc.stderr  # one line, no traceback, no TensorFlow noise
    assert message[0].startswith("tfgc-train: ")
    for word in words:
        assert word in message[0]
    assert "[w0]" not in proc.stdout + proc.stderr  # no worker was started
