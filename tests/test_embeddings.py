"""Embedding gradients (IndexedSlices) in one process: which mode each compressor takes,
what the rows path delivers and counts, and the state a densified table keeps.

The 2-worker runs of tests/test_user_models.py train a Transformer whose embedding
takes these modes under every compressor (workers bit-identical, bytes checked there).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc import compressors
from tfgc.distribute import embeddings

VOCAB, DIM = 300, 24
POLICY = tfgc.CompressionPolicy(min_elements=64)


def table(shape=(VOCAB, DIM)):
    return tf.Variable(tf.zeros(shape))


@pytest.mark.parametrize("spec, expected", [
    ("none", embeddings.STOCK), ("variance", embeddings.STOCK),
    # GradiVeQ compresses convolutions (its dense layers go dense unless asked).
    ("gradiveq", embeddings.STOCK), ("gradiveq:dense_layers=true", embeddings.DENSE),
    ("qsgd", embeddings.ROWS), ("terngrad", embeddings.ROWS), ("fp16", embeddings.ROWS),
    ("bf16", embeddings.ROWS),
    # Without memory, a function of the rows alone: k random entries of each block of
    # rows, its spectrum's largest coefficients.
    ("randomk", embeddings.ROWS), ("fft", embeddings.ROWS),
    # A vote is not a sum of decoded rows.
    ("signsgd", embeddings.DENSE),
    # State per row (the registry wraps scaledsign and onebit in error feedback), or a
    # choice among all entries.
    ("scaledsign", embeddings.DENSE),
    ("ef+qsgd", embeddings.DENSE), ("onebit", embeddings.DENSE), ("topk", embeddings.DENSE),
    ("ef+randomk", embeddings.DENSE), ("ef+topk", embeddings.DENSE), ("dgc", embeddings.DENSE),
    ("powersgd", embeddings.DENSE), ("efsignsgd", embeddings.DENSE),
    ("threshold", embeddings.DENSE), ("adaptive", embeddings.DENSE),
    ("graddrop", embeddings.DENSE), ("importance", embeddings.DENSE),
    # auto's rows take a quantizer of its plan, whatever its low-rank budget.
    ("auto", embeddings.ROWS), ("auto:low_rank=8", embeddings.ROWS),
    ("auto:low_rank=0", embeddings.ROWS),
])
def test_mode_of_each_compressor(spec, expected):
    assert embeddings.mode(compressors.get(spec), POLICY, table(), tf.float32) == expected


def test_mode_stock_where_the_policy_or_the_dtype_says_dense():
    qsgd = compressors.get("qsgd")
    assert embeddings.mode(qsgd, POLICY, table((4, 8)), tf.float32) == embeddings.STOCK
    assert embeddings.mode(qsgd, POLICY, table(), tf.float64) == embeddings.STOCK


def reduce_slices(spec, values, indices, steps=1, dense=None):
    """All-reduces IndexedSlices of a [VOCAB, DIM] table (and optionally a dense [16, 16]
    gradient) ``steps`` times on a one-worker strategy; returns (last outputs, strategy,
    owner)."""
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(spec, policy=POLICY)
    owner = tf.Module()
    with strategy.scope():
        var = table()
        kernel = tf.Variable(tf.zeros([16, 16]))

    @tf.function
    def step():
        def fn():
            grads = [tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                      tf.constant([VOCAB, DIM], tf.int64))]
            variables = [var]
            if dense is not None:
                grads.append(tf.constant(dense))
                variables.append(kernel)
            with tfgc.compress_gradients(variables, owner):
                return tf.distribute.get_replica_context().all_reduce("sum", grads)
        return strategy.run(fn)

    for _ in range(steps):
        out = step()
    return out, strategy, owner


def rows(m, seed=0):
    """m rows of distinct indices, in random order."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(m, DIM)).astype(np.float32),
            rng.permutation(VOCAB)[:m].astype(np.int64))


@pytest.mark.parametrize("m", [1, 170, 171, 300])
def test_rows_of_a_cast_arrive_cast_and_in_order(m):
    # Blocks of 4096 // 24 = 170 rows: one block exactly, one row over, several.
    values, indices = rows(m)
    (out,), strategy, _ = reduce_slices("fp16", values, indices)
    assert isinstance(out, tf.IndexedSlices)
    np.testing.assert_array_equal(out.indices.numpy(), indices)
    assert out.indices.dtype == tf.int64
    np.testing.assert_array_equal(out.values.numpy(), values.astype(np.float16).astype(np.float32))
    # Per step: the padded blocks (2 bytes a value, 4 an index) and 10 words ahead of
    # them (the row count and the guard's 9); the gradient stands for the whole table.
    stats = strategy.compression_stats()
    blocks = -(-m // 170)
    assert stats["payload_bytes"] == blocks * 170 * (DIM * 2 + 4) + 4 * 10
    assert stats["dense_bytes"] == VOCAB * DIM * 4


def test_repeated_rows_are_added_before_they_are_sent():
    values, indices = rows(120, seed=2)
    repeated = np.concatenate([indices, indices[:50], indices[:10]])
    doubled = np.concatenate([values, values[:50], values[:10]])
    (out,), strategy, _ = reduce_slices("fp16", doubled, repeated)
    # One row per distinct index, in order of first appearance.
    np.testing.assert_array_equal(out.indices.numpy(), indices)
    summed = values.copy()
    summed[:50] += values[:50]
    summed[:10] += values[:10]
    np.testing.assert_array_equal(out.values.numpy(),
                                  summed.astype(np.float16).astype(np.float32))
    # 120 rows sent (one block of 170), not 180 (two).
    assert strategy.compression_stats()["payload_bytes"] == 170 * (DIM * 2 + 4) + 40


def test_rows_of_qsgd_keep_their_signs_and_draw_anew_each_step():
    values, indices = rows(64, seed=1)
    outs = []
    for steps in (1, 2):
        (out,), _, _ = reduce_slices("qsgd:levels=1", values, indices, steps=steps)
        np.testing.assert_array_equal(out.indices.numpy(), indices)
        outs.append(out.values.numpy())
    # One level: each entry decodes to 0 or its bucket's norm (at most the whole
    # block's), with its sign; the second step draws other roundings.
    assert not np.array_equal(outs[0], outs[1])
    norm = np.linalg.norm(values)
    for out in outs:
        assert np.all(np.sign(out[out != 0]) == np.sign(values[out != 0]))
        assert np.abs(out).max() <= norm * (1 + 1e-6)


@pytest.mark.parametrize("label", ["rqsgd8", "rqsgd4"])
def test_rotated_rows_decode_under_the_rotation_they_were_encoded_with(label):
    # A rotation's signs are drawn from the step and the block: each block was encoded
    # under step * 2^16 + its number but decoded under the step alone, so every block
    # (every block after step 0's first) came back un-rotated with other signs: a
    # relative error of about 1.4 where rotated 8 bits bound it at 2.5e-4. Two blocks
    # of rows (170 a block), at the third step.
    from tfgc.distribute import planner

    candidate = planner.BY_LABEL[label]
    values, indices = rows(300, seed=4)
    (out,), _, _ = reduce_slices(candidate.spec, values, indices, steps=3)
    np.testing.assert_array_equal(out.indices.numpy(), indices)
    for block in (slice(0, 170), slice(170, 300)):
        x, y = values[block], out.values.numpy()[block]
        error = np.sum((y - x) ** 2) / np.sum(x ** 2)
        # The bound is on the expected squared error; one draw of thousands of entries
        # lies within a few times it.
        assert error <= 4 * candidate.variance_bound(embeddings.BLOCK_ENTRIES), (block, error)


def test_rows_with_a_nan_come_out_nan_and_the_step_is_counted_non_finite():
    values, indices = rows(50)
    values[3, 5] = np.nan
    (out,), strategy, owner = reduce_slices("qsgd", values, indices)
    assert np.isnan(out.values.numpy()).all()
    assert strategy.compression_stats()["nonfinite_steps"] == 1
    state = tfgc.distribute.state.get_state(owner)
    assert int(state.step(0).numpy()) == 0


def test_rows_advance_the_step_counter_once_per_step_with_dense_gradients_or_without():
    values, indices = rows(50)
    _, _, owner = reduce_slices("qsgd", values, indices, steps=3)
    assert int(tfgc.distribute.state.get_state(owner).step(0).numpy()) == 3
    dense = np.ones([16, 16], np.float32)
    _, _, owner = reduce_slices("qsgd", values, indices, steps=3, dense=dense)
    assert int(tfgc.distribute.state.get_state(owner).step(0).numpy()) == 3


def test_dense_mode_sums_repeated_rows_and_keeps_a_residual_per_row():
    # Top-1 with error feedback: one entry of the table is sent, every other entry of the
    # rows the batch touched stays in the residual, rows it did not touch stay zero.
    values = np.zeros([3, DIM], np.float32)
    values[0, 0], values[1, 0], values[2, 1] = 1.0, 2.0, 0.5
    indices = np.array([7, 7, 9], np.int64)  # row 7 twice: 3.0 in all
    (out,), _, owner = reduce_slices("ef+topk:ratio=0.0001", values, indices)
    out = tf.convert_to_tensor(out).numpy()
    expected = np.zeros([VOCAB, DIM], np.float32)
    expected[7, 0] = 3.0
    np.testing.assert_array_equal(out, expected)
    state = tfgc.distribute.state.get_state(owner)
    residuals = [v.numpy() for v in state.variables() if v.shape == (VOCAB, DIM)]
    assert len(residuals) == 1
    leftover = np.zeros([VOCAB, DIM], np.float32)
    leftover[9, 1] = 0.5
    np.testing.assert_array_equal(residuals[0], leftover)
