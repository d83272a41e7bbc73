"""The strategy in one process (no TF_CONFIG): what a notebook does with it."""

import gc
import threading
import weakref

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfgc
from tfgc.distribute import iterators


def test_several_strategies_in_one_process_train_one_after_another():
    # A second strategy once reused the first one's collective keys, and its
    # first step met the first one's collectives in the runtime (a shape mismatch).
    x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    y = 2.0 * x[:, :4]
    bases = []
    for compressor, width in (("ef+topk:ratio=0.1", 32), ("qsgd", 48), ("none", 40)):
        strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
            compressor, policy=tfgc.CompressionPolicy(min_elements=0))
        bases.append(strategy.extended._collective_key_base)  # pylint: disable=protected-access
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(width, activation="relu",
                                                         input_shape=(16,)),
                                      keras.layers.Dense(4)])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        assert strategy.compression_stats()["steps"] == 8, compressor
        assert np.isfinite(history.history["loss"]).all(), compressor
    assert len(set(bases)) == 3
    # None takes the stock strategy's keys (tests/cluster/paths.py trains a stock
    # strategy before tfgc's on real clusters).
    stock = tf.distribute.MultiWorkerMirroredStrategy()
    assert stock.extended._collective_key_base not in bases  # pylint: disable=protected-access


def test_the_first_fit_traces_its_train_function_once():
    # With the optimizer's variables made before fit (Keras 3 makes them itself, tf-keras
    # on request), TensorFlow keeps a train function's first trace. The compressor-switch
    # guard's variable, made during that trace through the variable creators, had it
    # traced a second time: the first step of a large model paid two traces.
    x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    y = 2.0 * x[:, :4]
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        "qsgd", policy=tfgc.CompressionPolicy(min_elements=0))
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(32, activation="relu", input_shape=(16,)),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.optimizer.build(model.trainable_variables)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert strategy.compression_stats()["steps"] == 8
    assert model.train_function.experimental_get_tracing_count() == 1


def _table_model(compressor):
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        compressor, policy=tfgc.CompressionPolicy(min_elements=0))
    with strategy.scope():
        model = keras.Sequential([keras.layers.Embedding(50, 8, input_length=6, name="table"),
                                  keras.layers.Flatten(),
                                  keras.layers.Dense(4, name="head")])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return strategy, model


@pytest.mark.parametrize("to", ["none", "qsgd"])
def test_a_switch_that_sends_an_embedding_as_rows_sends_its_residual_with_them(monkeypatch, to):
    # Under error feedback an embedding's gradient goes densified, with a residual of
    # the table's shape; identity and QSGD send its rows as they are. The switch keeps
    # the residual apart, and the next step sends its rows that hold anything with the
    # step's own rows, once: with identity (exact), the table moves by the learning
    # rate times the step's gradient plus that residual. Nothing is dropped.
    from tfgc.distribute import state as state_lib
    warnings = []
    monkeypatch.setattr(state_lib.logging, "warning",
                        lambda fmt, *args: warnings.append(fmt % args))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, size=(64, 6))  # rows 40-49 untouched: their residual stays 0
    y = rng.normal(size=(64, 4)).astype(np.float32)
    strategy, model = _table_model("ef+topk:ratio=0.1")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    state = state_lib.get_state(model.optimizer)
    table, kernel = model.get_layer("table").embeddings, model.get_layer("head").kernel
    residual = state.slot(table, 0)["residual"].numpy()
    assert np.any(residual) and not np.any(residual[40:])
    strategy.compressor = to
    xb, yb = x[:16], y[:16]
    before = table.numpy()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb) - yb))
    grad = tf.convert_to_tensor(tape.gradient(loss, table)).numpy()
    model.train_on_batch(xb, yb)
    assert not [w for w in warnings if "is dropped" in w], warnings
    assert not np.any(state.carried(table, 0).numpy())
    assert not state.carried_rows_pending(table, 0).numpy()
    assert not state.carried_pending(0).numpy()
    after = table.numpy()
    if to == "none":
        np.testing.assert_allclose(after, before - 0.05 * (grad + residual), atol=1e-6)
    else:
        # QSGD's rows are unbiased draws: every row that held a residual or a gradient
        # moved, and no other.
        moved = np.any(after != before, axis=1)
        held = np.any(residual != 0, axis=1) | np.any(grad != 0, axis=1)
        assert np.array_equal(moved, held)
    # The kernel's residual went with its next gradient: sent, then zeroed.
    carried = state.carried(kernel, 0)
    assert carried is not None and not np.any(carried.numpy())
    # A second step sends the table's rows alone.
    model.train_on_batch(xb, yb)
    assert np.isfinite(model.get_weights()[0]).all()


def _dropped_on(objects):
    """The names of the threads on which ``objects`` are deleted, as they are."""
    names = []
    for obj in objects:
        weakref.finalize(obj, lambda: names.append(threading.current_thread().name))
    return names


def _join_releases():
    for thread in threading.enumerate():
        if thread.name == "tfgc-iterator-release":
            thread.join(60)


@pytest.mark.parametrize("from_function", [False, True])
def test_iterators_are_torn_down_on_a_thread_of_their_own(from_function):
    # TensorFlow's deletion of a distributed iterator can wait seconds on tf.data's
    # autotuning threads (tfgc/distribute/iterators.py); the strategy's iterators hand
    # their workers' iterators to a thread that drops them, and yield what the stock
    # strategy's do.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy()
    data = tf.data.Dataset.range(12).batch(4)
    if from_function:
        dist = strategy.distribute_datasets_from_function(lambda _: data)
        stock = tf.distribute.Strategy.distribute_datasets_from_function(strategy, lambda _: data)
    else:
        dist = strategy.experimental_distribute_dataset(data)
        stock = tf.distribute.Strategy.experimental_distribute_dataset(strategy, data)
    assert isinstance(dist, type(stock)) and type(dist) is not type(stock)
    ours = [x.numpy().tolist() for x in dist]
    assert ours == [x.numpy().tolist() for x in stock] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                        [8, 9, 10, 11]]
    iterator = iter(dist)
    first = next(iterator).numpy().tolist()
    parts = list(iterator._iterators)  # pylint: disable=protected-access
    assert parts and first == [0, 1, 2, 3]
    names = _dropped_on(parts)
    del parts
    main = threading.current_thread().name
    del iterator
    _join_releases()
    gc.collect()
    assert names and set(names) == {"tfgc-iterator-release"}, (names, main)
    # An iterator that stays alive keeps its workers' iterators.
    kept = iter(dist)
    next(kept)
    gc.collect()
    _join_releases()
    assert next(kept).numpy().tolist() == [4, 5, 6, 7]


def test_a_distributed_dataset_is_wrapped_once():
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy()
    dist = strategy.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2))
    cls = type(dist)
    assert iterators.distribute(dist) is dist and type(dist) is cls
    assert [x.numpy().tolist() for x in dist] == [[0, 1], [2, 3]]
