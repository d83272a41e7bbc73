"""Sparsifiers: top-k and random-k.

Both send k = ceil(ratio * n) values of each gradient. Top-k picks the k largest
magnitudes, so every worker picks different coordinates and the payload is
(values, int32 indices), exchanged by all-gather. Random-k draws its coordinates
from a seed shared by all workers, so the k values line up and add element-wise:
only the values cross the wire, through a plain all-reduce.

Neither keeps what it drops; wrap them in ``ErrorFeedback`` (``"ef+topk:..."``) to
carry the remainder into the next step, as sparsified SGD with memory does
(Stich, Cordonnier & Jaggi 2018; Aji & Heafield 2017).
"""

import math

import tensorflow as tf

from tfgc.compressors.base import (Compressor, check_int, check_positive_float, check_ratio,
                                   num_elements)
from tfgc.ops import sparsify


def _k_for(n: int, ratio: float, k: int) -> int:
    if k:
        return min(k, n)
    return min(n, max(1, int(math.ceil(ratio * n))))


class TopK(Compressor):
    """Keeps the k entries of largest magnitude.

    Args:
      ratio: fraction of entries kept, in (0, 1]. Default 0.01.
      k: if non-zero, keep exactly this many entries per tensor (overrides ratio).

    Wire: k float values and k int32 indices, 64 bits per kept entry.

    Example: ``tfgc.get_compressor("ef+topk:ratio=0.001")``.
    """

    name = "topk"
    summable = False
    # The index_selection part: whether the paper aggregates over one worker's set.
    shares_indices = False

    def __init__(self, ratio: float = 0.01, k: int = 0):
        self.ratio = check_ratio("ratio", ratio)
        self.k = check_int("k", k, 0)

    def num_kept(self, shape) -> int:
        return _k_for(num_elements(shape), self.ratio, self.k)

    def compress(self, x, state, ctx):
        payload, state, _ = self.compress_with_feedback(x, tf.zeros_like(x), state, ctx)
        return payload, state

    # -- parts (tfgc.compressors.protocols) --------------------------------------------

    @property
    def index_selection(self):
        """This sparsifier: one worker's top-k index set can serve every worker."""
        return self

    @property
    def sparse_entries(self):
        """This sparsifier: its payload is (values, int32 flat indices)."""
        return self

    @staticmethod
    def entries(payload):
        values, indices = payload
        return values, indices

    def num_selected(self, shape) -> int:
        return self.num_kept(shape)

    def select_indices(self, v, ctx):
        k = self.num_kept(v.shape)
        out = sparsify.sparsify_with_residual(v, tf.zeros_like(v), k, exact=True)
        return tf.ensure_shape(out.indices, [k])

    def compress_with_feedback(self, x, residual, state, ctx):
        # One fused kernel: v = x + residual, exact top-k of |v| (ties to the lower
        # index, indices ascending), and the new residual with the sent entries zeroed.
        k = self.num_kept(x.shape)
        out = sparsify.sparsify_with_residual(x, residual, k, exact=True)
        values = tf.ensure_shape(out.values, [k])
        indices = tf.ensure_shape(out.indices, [k])
        return (values, indices), state, out.new_residual

    def decompress(self, payload, shape, dtype, ctx):
        values, indices = payload
        # The kernel checks every index against the tensor size: a payload from
        # another worker can fail with InvalidArgument, never write out of bounds.
        dense = sparsify.scatter_add_payloads(tf.cast(values, dtype), indices, num_elements(shape))
        return tf.reshape(dense, shape)

    def aggregate(self, payloads, shape, dtype, ctx):
        # One scatter-add over all workers' entries instead of N dense decodes.
        values = tf.concat([tf.cast(p[0], dtype) for p in payloads], axis=0)
        indices = tf.concat([p[1] for p in payloads], axis=0)
        return self.decompress((values, indices), shape, dtype, ctx)


class Importance(TopK):
    """Importance-weighted pruning (Cheng & Xu 2019): the k entries of largest
    |v_j| / (|w_j| + eps), v the gradient plus residual and w the variable's value.

    A gradient that is large next to its weight moves that weight the most in
    relative terms, which is the paper's importance |g_j| / |w_j|. The paper
    aggregates over one worker's index set, broadcast to all, with the values summed
    by the plain ring all-reduce and the rest kept in the residual: auto sends it
    over ``communication="shared_index"`` (the root in rotation), and error feedback
    is part of the algorithm (``"importance"`` means ``"ef+importance"``).

    Args:
      ratio: fraction of entries kept, in (0, 1]. Default 0.01.
      k: if non-zero, keep exactly this many entries per tensor (overrides ratio).
      eps: guard for weights at or near 0, added to |w|; > 0, default 1e-6. The
        paper's formula has none; with it an entry whose weight is exactly zero
        ranks by |v| / eps, first among equals, instead of dividing by zero.

    Wire: as top-k, 64 bits per kept entry; on the shared-index path both halves are
    all-reduced, 2(N-1)/N of them per worker.
    """

    name = "importance"
    requires_error_feedback = True
    needs_weights = True
    shares_indices = True  # Cheng & Xu aggregate over one worker's index set

    def __init__(self, ratio: float = 0.01, k: int = 0, eps: float = 1e-6):
        super().__init__(ratio=ratio, k=k)
        self.eps = check_positive_float("eps", eps)

    def scores(self, v, weight):
        if weight is None:
            raise ValueError("importance-weighted pruning needs the variables' values: reduce "
                             "gradients with tfgc.compress_gradients(variables) or model.fit")
        w = tf.cast(tf.reshape(weight, [-1]), v.dtype)
        return tf.abs(tf.reshape(v, [-1])) / (tf.abs(w) + tf.cast(self.eps, v.dtype))

    def select_indices(self, v, ctx):
        # The top-k kernel on the scores: ties to the lower index, ascending.
        k = self.num_kept(v.shape)
        scores = self.scores(v, ctx.weight)
        out = sparsify.sparsify_with_residual(scores, tf.zeros_like(scores), k, exact=True)
        return tf.ensure_shape(out.indices, [k])

    def compress_with_feedback(self, x, residual, state, ctx):
        v = tf.reshape(x + residual, [-1])
        indices = self.select_indices(v, ctx)
        values = tf.gather(v, indices)
        kept = tf.tensor_scatter_nd_update(v, indices[:, None], tf.zeros_like(values))
        return (values, indices), state, tf.reshape(kept, x.shape)


class RandomK(Compressor):
    """Keeps k uniformly random entries, the same coordinates on every worker.

    Args:
      ratio: fraction of entries kept, in (0, 1]. Default 0.01.
      seed: base seed; workers derive identical per-step, per-tensor streams from it.
      unbiased: scale kept values by n/k so the estimate is unbiased (without error
        feedback); leave False when wrapping in ErrorFeedback.

    Wire: k float values (the indices are regenerated from the shared seed).
    """

    name = "randomk"
    summable = True

    def __init__(self, ratio: float = 0.01, seed: int = 0, unbiased: bool = False):
        self.ratio = check_ratio("ratio", ratio)
        self.seed = check_int("seed", seed, 0)
        if not isinstance(unbiased, bool):
            raise ValueError(f"`unbiased` must be a bool, got {unbiased!r}")
        self.unbiased = unbiased

    def _indices(self, shape, ctx):
        n = num_elements(shape)
        k = _k_for(n, self.ratio, 0)
        if k == n:
            return tf.range(n, dtype=tf.int32)
        seed = ctx.seed(self.seed, shared=True)

        def by_ranking():
            # The k smallest of n uniform keys: a uniform k-subset, O(n).
            keys = tf.random.stateless_uniform([n], seed=seed)
            return tf.math.top_k(keys, k=k, sorted=False).indices

        if 4 * k > n:
            return by_ranking()
        # Sparse regime: the first k distinct values of a stream of i.i.d.
        # uniform indices are a uniform k-subset too (each new distinct value is
        # uniform over the ones not yet drawn), and cost O(k) instead of O(n).
        # m draws hold n (1 - (1 - 1/n)^m) distinct values on average, so m is
        # chosen to make that k, plus a margin of 6 standard deviations (the
        # count's variance is below k). Falling short is then a < 1e-9 event,
        # handled by the O(n) ranking so that the result never changes shape.
        m = int(math.ceil(-n * math.log1p(-k / n) + 6.0 * math.sqrt(k) + 16))
        draws = tf.random.stateless_uniform([m], seed=seed, minval=0, maxval=n, dtype=tf.int32)
        distinct, _ = tf.unique(draws)
        indices = tf.cond(tf.size(distinct) >= k, lambda: distinct[:k], by_ranking)
        # Both branches hold k entries; the static shape says so for the
        # payload's wire size and for graph-mode consumers.
        return tf.ensure_shape(indices, [k])

    def compress(self, x, state, ctx):
        flat = tf.reshape(x, [-1])
        values = tf.gather(flat, self._indices(x.shape, ctx))
        if self.unbiased:
            values = values * tf.cast(num_elements(x.shape) / int(values.shape[0]), values.dtype)
        return (values,), state

    def decompress(self, payload, shape, dtype, ctx):
        indices = self._indices(shape, ctx)
        dense = tf.scatter_nd(indices[:, None], tf.cast(payload[0], dtype), [num_elements(shape)])
        return tf.reshape(dense, shape)


def keep_largest(values, picked, new_v, k):
    """A threshold's selection (``values`` at ascending flat indices ``picked``, with
    ``new_v`` the residual where they are zeroed) cut to its k largest |v| when longer;
    the rest goes back to the residual (DGC's sampled threshold, gradient dropping).

    Indices stay ascending. A selection of k or fewer is returned as it is.
    """
    def largest():
        count = tf.shape(picked)[0]
        kept = tf.sort(tf.math.top_k(tf.abs(values), k, sorted=False).indices)
        dropped = tf.logical_not(tf.scatter_nd(kept[:, None], tf.ones([k], tf.bool), [count]))
        restored = tf.tensor_scatter_nd_update(
            new_v, tf.boolean_mask(picked, dropped)[:, None], tf.boolean_mask(values, dropped))
        return tf.gather(values, kept), tf.gather(picked, kept), restored

    return tf.cond(tf.shape(picked)[0] > k, largest, lambda: (values, picked, new_v))
