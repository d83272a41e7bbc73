"""Sparse all-reduce with a dense switch (SparCML's recursive doubling; Kylix).

Every worker holds a sparse set of (index, value) pairs over one index space. At
stage s of recursive doubling it exchanges its current set with the partner
``rank ^ 2**s`` and both merge (union of indices, values added), so after log2(N)
stages every worker holds the sum of all sets. Sets fill in as they merge; a stage
whose two sets together cover half the space or more (the break-even of 8-byte
pairs against 4-byte dense values) switches both partners to the dense vector, and
they stay dense. So no stage sends more than the dense vector would.

Set sizes differ between workers and are known only at run time: each stage first
exchanges the two counts, then both pad to the larger one. With N not a power of
two, the workers above the largest power of two P first fold their set into worker
``rank - P``, sit out the doubling, and get the merged set back at the end (sparse
while it is sparse).

Both partners of a stage add the same two values for an index (a + b = b + a), so
every worker ends with the same bits.
"""

from typing import Tuple

import tensorflow as tf

from tfgc.collectives.pairwise import PairExchanger


def _exchange_set(ex: PairExchanger, partner: int, idx, val, length: int):
    """One stage: this worker's set and the partner's, merged (sparse or dense)."""
    count = tf.size(idx)
    theirs_count = ex.exchange(partner, tf.reshape(count, [1]))[0]
    go_dense = 2 * (count + theirs_count) >= length

    def dense():
        mine = tf.scatter_nd(idx[:, None], val, [length])
        total = mine + ex.exchange(partner, mine)
        return tf.range(length, dtype=tf.int32), total, 4 * length

    def sparse():
        m = tf.maximum(count, theirs_count)
        pad = m - count
        sent = tf.concat([tf.pad(idx, [[0, pad]], constant_values=-1),
                          tf.bitcast(tf.pad(val, [[0, pad]]), tf.int32)], axis=0)
        got = ex.exchange(partner, sent)
        their_idx, their_val = got[:m], tf.bitcast(got[m:], tf.float32)
        keep = their_idx >= 0
        all_idx = tf.concat([idx, tf.boolean_mask(their_idx, keep)], axis=0)
        all_val = tf.concat([val, tf.boolean_mask(their_val, keep)], axis=0)
        unique, position = tf.unique(all_idx)
        return unique, tf.math.unsorted_segment_sum(all_val, position, tf.size(unique)), 8 * m

    out_idx, out_val, sent_bytes = tf.cond(go_dense, dense, sparse)
    # Each exchange carries a 4-byte rank tag; the count exchange 4 bytes more.
    return out_idx, out_val, 12 + tf.cast(sent_bytes, tf.int64)


def sparse_all_reduce(ex: PairExchanger, num_ranks: int, indices: tf.Tensor, values: tf.Tensor,
                      length: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """Sums every worker's (indices, values) set over ``[length]``.

    Args:
      ex: this replica's pairwise exchanger.
      num_ranks: the number of replicas in the group.
      indices: int32 ``[m]``, distinct, in ``[0, length)``.
      values: float32 ``[m]``.
      length: size of the index space.

    Returns:
      ``(dense_sum, sent_bytes)``: the float32 ``[length]`` sum, the same on every
      worker, and the bytes this worker sent (an int64 scalar known at run time).
    """
    rank = ex.rank
    power = 1
    while power * 2 <= num_ranks:
        power *= 2
    sent = tf.constant(0, tf.int64)
    idx = tf.cast(tf.reshape(indices, [-1]), tf.int32)
    val = tf.cast(tf.reshape(values, [-1]), tf.float32)
    if rank >= power:
        # Fold into rank - power, then take the sum back: an exchange with an
        # empty set of one's own returns the partner's set, sparse while it is.
        partner = rank - power
        _, _, fold_bytes = _exchange_set(ex, partner, idx, val, length)
        idx, val, back_bytes = _exchange_set(ex, partner, tf.zeros([0], tf.int32),
                                             tf.zeros([0], tf.float32), length)
        return tf.scatter_nd(idx[:, None], val, [length]), sent + fold_bytes + back_bytes
    if rank + power < num_ranks:
        idx, val, stage_bytes = _exchange_set(ex, rank + power, idx, val, length)
        sent += stage_bytes
    stage = 1
    while stage < power:
        idx, val, stage_bytes = _exchange_set(ex, rank ^ stage, idx, val, length)
        sent += stage_bytes
        stage *= 2
    if rank + power < num_ranks:
        _, _, back_bytes = _exchange_set(ex, rank + power, idx, val, length)
        sent += back_bytes
    return tf.scatter_nd(idx[:, None], val, [length]), sent
