"""Word packing used on the wire: codes into int32 words, payload dtypes into words."""

import numpy as np
import pytest
import tensorflow as tf

from tfgc.collectives import allgather
from tfgc.ops import packing


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n", [0, 1, 7, 31, 32, 33, 1001])
def test_codes_round_trip(bits, n):
    rng = np.random.default_rng(n + bits)
    codes = rng.integers(0, 1 << bits, size=n).astype(np.int32)
    words = packing.pack_codes(tf.constant(codes), bits)
    assert words.dtype == tf.int32 and words.shape == [packing.packed_words(n, bits)]
    np.testing.assert_array_equal(packing.unpack_codes(words, n, bits).numpy(), codes)


def test_codes_layout_is_lsb_first():
    words = packing.pack_codes(tf.constant([1, 2, 3], tf.int32), 2)
    assert int(words[0]) == 1 | (2 << 2) | (3 << 4)


def test_unpack_rejects_wrong_word_count():
    with pytest.raises(tf.errors.InvalidArgumentError):
        packing.unpack_codes(tf.zeros([3], tf.int32), 200, 4)


@pytest.mark.parametrize("dtype", [tf.float32, tf.int32, tf.float16, tf.bfloat16, tf.int8, tf.uint8])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8])
def test_dtype_words_round_trip(dtype, n):
    values = tf.cast(tf.range(n) * 3 - 4, dtype) if dtype != tf.uint8 else tf.cast(tf.range(n) * 3, dtype)
    w = packing.to_words(values)
    assert w.dtype == tf.int32 and w.shape == [packing.num_words(n, dtype)]
    np.testing.assert_array_equal(packing.from_words(w, dtype, n).numpy(), values.numpy())


def test_payload_words_concatenate_and_split_back():
    payload = (tf.constant([1.5, -2.0, 3.25]), tf.constant([7, 8, 9], tf.int32),
               tf.constant([0.5, 1.5, 2.5], tf.float16))
    w = allgather.payload_words(payload)
    assert w.shape == [3 + 3 + 2]
    back = allgather.unpack_payload_words(w, payload)
    for a, b in zip(back, payload):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
