"""The guard's control words: one encoding, decoded the same whether summed or gathered."""

import numpy as np
import pytest
import tensorflow as tf

from tfgc.distribute.paths import guard


def rows(bads, steps, dtype):
    return tf.stack([guard.control_words(tf.constant(b), tf.constant(s, tf.int64), dtype)
                     for b, s in zip(bads, steps)])


@pytest.mark.parametrize("dtype", [tf.float32, tf.int32])
@pytest.mark.parametrize("steps,agree", [
    ([7, 7, 7], True), ([0, 0], True), ([2 ** 32 + 5, 5], True),  # low 32 bits only
    ([7, 8, 7], False), ([4, 6], False),  # 4 + 6 = 2 * 5: the squares tell them apart
    ([1 << 24, 1 << 16], False), ([255, 256, 257, 254], False)])
def test_summed_and_gathered_rows_give_the_same_answer(dtype, steps, agree):
    assert guard.CONTROL_WORDS == 9
    gathered = rows([0] * len(steps), steps, dtype)
    assert gathered.shape == (len(steps), guard.CONTROL_WORDS)
    for control in (gathered, tf.reduce_sum(gathered, axis=0)):
        any_bad, steps_agree, _ = guard.agree(control, len(steps))
        assert not bool(any_bad)
        assert bool(steps_agree) == agree
    _, _, seen = guard.agree(gathered, len(steps))
    np.testing.assert_array_equal(seen.numpy(), [s % 2 ** 32 for s in steps])


def test_one_bad_worker_is_seen_by_every_decoding():
    gathered = rows([0, 1, 0], [3, 3, 3], tf.int32)
    assert bool(guard.agree(gathered, 3)[0])
    assert bool(guard.agree(tf.reduce_sum(gathered, 0), 3)[0])
    assert not bool(guard.ok(gathered, 3, tf.constant(3, tf.int64)))


def test_steps_that_differ_stop_with_the_counters():
    gathered = rows([0, 0], [3, 4], tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="step counters differ"):
        guard.ok(gathered, 2, tf.constant(3, tf.int64))
