"""No silent fallbacks: every gradient sent as it is, counted and named with its reason.

* ``CompressionPolicy.reason``: one fixed phrase per cause, None exactly when the
  gradient is compressed;
* a model trained in one process: ``uncompressed_gradients()`` names each gradient
  sent as it is (biases, a small kernel, an embedding's rows on the stock gather,
  everything under identity), and the statistics count them and their bytes.

The reduce-scatter's own cause (a gradient with fewer elements than workers) is
checked on a real cluster in ``tests/test_overlap.py``.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfgc


def spec(shape, dtype=tf.float32):
    return tf.TensorSpec(shape, dtype)


def test_reason_names_each_cause_and_none_when_compressed():
    policy = tfgc.CompressionPolicy()  # min_elements 1024, no vectors
    qsgd = tfgc.get_compressor("qsgd")
    cases = [
        (spec([None, 64]), "shape known only at run time"),
        (spec([64, 64], tf.int32), "not floating point"),
        (spec([4096]), "a vector (compress_vectors=False)"),
        (spec([]), "a scalar (compress_vectors=False)"),
        (spec([10, 10]), "fewer than min_elements=1024 elements"),
        (spec([64, 64], tf.float64), "float64, which qsgd does not take"),
        (spec([64, 64]), None),
    ]
    for tensor, want in cases:
        assert policy.reason(tensor, qsgd) == want, tensor
        assert policy.should_compress(tensor, qsgd) == (want is None)
    # A shape the compressor declines: GradiVeQ takes convolution kernels only.
    gradiveq = tfgc.get_compressor("gradiveq")
    assert policy.reason(spec([256, 256]), gradiveq) == "a shape gradiveq does not take"
    assert policy.reason(spec([3, 3, 64, 64]), gradiveq) is None
    vectors = tfgc.CompressionPolicy(min_elements=16, compress_vectors=True)
    assert vectors.reason(spec([4096]), qsgd) is None
    assert vectors.reason(spec([]), qsgd) == "fewer than min_elements=16 elements"


def _train(compressor):
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor)
    rng = np.random.default_rng(0)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(64, activation="relu", input_shape=(16,)),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(rng.normal(size=(32, 16)).astype(np.float32),
              rng.normal(size=(32, 4)).astype(np.float32), batch_size=16, epochs=1, verbose=0)
    return strategy, model


def test_every_gradient_sent_as_it_is_is_named_with_its_reason_and_counted():
    strategy, model = _train("qsgd")
    listed = {e["variable"]: e for e in strategy.uncompressed_gradients()}
    kernel0, bias0, kernel1, bias1 = model.trainable_variables
    # 16 x 64 is compressed; the biases are vectors; 64 x 4 has 256 < 1024 elements.
    assert set(listed) == {bias0.name, kernel1.name, bias1.name}
    assert listed[bias0.name]["reason"] == "a vector (compress_vectors=False)"
    assert listed[kernel1.name]["reason"] == "fewer than min_elements=1024 elements"
    assert listed[kernel1.name]["bytes"] == 64 * 4 * 4
    stats = strategy.compression_stats()
    assert stats["uncompressed_tensors"] == 3
    assert stats["uncompressed_bytes"] == 4 * (64 + 256 + 4)


def test_identity_lists_every_gradient():
    strategy, model = _train("none")
    listed = strategy.uncompressed_gradients()
    assert len(listed) == len(model.trainable_variables)
    kernel0 = model.trainable_variables[0]
    reasons = {e["variable"]: e["reason"] for e in listed}
    assert reasons[kernel0.name] == "compressor none"
    assert strategy.compression_stats()["uncompressed_bytes"] == 4 * sum(
        int(np.prod(v.shape)) for v in model.trainable_variables)


@pytest.mark.parametrize("compressor,why", [
    ("none", "compressor none"),
    ("qsgd", "embedding rows on the stock gather: fewer than min_elements=4096 elements")])
def test_embedding_rows_on_the_stock_gather_are_listed(compressor, why):
    # Identity, and a policy that leaves the 50 x 64 table (3200 elements) out.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        compressor, policy=tfgc.CompressionPolicy(min_elements=4096))
    with strategy.scope():
        ids = keras.Input((4,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 64)(ids))
        model = keras.Model(ids, keras.layers.Dense(4)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.integers(0, 50, size=(32, 4)).astype(np.int32),
              rng.normal(size=(32, 4)).astype(np.float32), batch_size=16, verbose=0)
    table = model.trainable_variables[0]
    entry = {e["variable"]: e for e in strategy.uncompressed_gradients()}[table.name]
    assert entry["reason"] == why
    # The rows a step sends change with its batch: no static size.
    assert entry["bytes"] is None
    assert strategy.compression_stats()["uncompressed_bytes"] > 0
