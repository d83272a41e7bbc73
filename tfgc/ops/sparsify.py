"""Gradient sparsification with error feedback, and its decode.

Each public function runs the compiled kernel from ``_tfgc_ops.so`` when it is
available (see ``tfgc.ops._loader``) and otherwise its ``*_reference`` twin,
written in plain TensorFlow.

Error feedback (Strom 2015; Seide et al. 2014; Lin et al. 2018): a worker
adds the residual left over from earlier steps to its new gradient,
``v = x + residual`` (computed in ``x.dtype``, exactly like ``x + residual``),
sends a few entries of ``v`` as ``(values, indices)`` and keeps the rest as
the new residual. Nothing is lost: scattering ``values`` to ``indices`` and
adding ``new_residual`` gives back ``v`` bit for bit.

Conventions shared by the selection ops:

* Tensors are flattened row-major; ``indices`` are int32 flat indices in
  ascending order, so a tensor may hold at most ``2**31`` elements.
* Ranking by magnitude: larger ``|v|`` first, ``+-inf`` on top, ``-0.0`` ties
  with ``+0.0``, NaN below every number (so NaN is only sent when ``k``
  exceeds the number of non-NaN entries, e.g. ``k >= n``), and equal
  magnitudes go to the lower index. Results are therefore deterministic.
* Sent entries become ``+0.0`` in ``new_residual``.
* ``mask`` is a bool ``[n]`` marking the sent entries when ``with_mask`` is
  set, and an empty ``[0]`` tensor otherwise.

Modes of :func:`sparsify_with_residual`:

* ``exact=True``: exactly ``min(k, n)`` entries, the top of the ranking. The
  kernel and the reference agree bit for bit.
* ``exact=False`` (Deep Gradient Compression, Lin et al. 2018): the threshold
  is the ``round(k * s / n)``-th largest ``|v|`` of a sample of
  ``s = max(ceil(sample_ratio * n), min(n, 256))`` entries, deterministic
  given ``seed``; entries with ``|v| >= threshold`` are selected. While fewer
  than ``ceil(0.8 k)`` pass, the threshold is multiplied by 0.8 (at most 10
  times, then exact selection takes over); when more than
  ``max(k, floor(1.3 k))`` pass, the exact top ``k`` of the selected ones is
  kept. So the count is always in ``[ceil(0.8 k), max(k, floor(1.3 k))]``, and
  every sent ``|v|`` is ``>=`` every unsent (non-NaN) ``|v|``. The kernel
  samples runs of 16 consecutive entries at random offsets in equal strata;
  the reference samples single positions with ``tf.random.stateless_uniform``,
  so the two pick slightly different (equally valid) sets in this mode. The
  GPU kernel makes the exact selection in this mode too (a radix select costs
  no more there than sampling), which is one of the allowed results.
"""

import collections

import tensorflow as tf

from tfgc.ops import _loader
from tfgc.ops._validation import Checks, float32_scalar, float_tensor, int64_scalar, invalid, to_tensor

# int32 indices address at most 2^31 elements.
MAX_ELEMENTS = 2**31
_MIN_SAMPLE = 256
_MIN_FRACTION = 0.8
_MAX_FRACTION = 1.3
_LOWER_FACTOR = 0.8
_MAX_LOWERINGS = 10

Sparsified = collections.namedtuple("Sparsified", ["values", "indices", "new_residual", "mask"])

# Selections and index payloads are not differentiable.
for _op_type in ("TfgcSparsifyWithResidual", "TfgcSparsifyByThreshold", "TfgcScatterAddPayloads"):
    try:
        tf.no_gradient(_op_type)
    except KeyError:  # already registered, e.g. on module reload
        pass


def _selection_inputs(x, residual):
    x = float_tensor(x, "x")
    residual = float_tensor(residual, "residual", x.dtype)
    if x.shape.is_fully_defined() and residual.shape.is_fully_defined():
        if x.shape != residual.shape:
            invalid(f"x and residual must have the same shape, got {x.shape} and {residual.shape}")
    return x, residual


def _sample_ratio(sample_ratio):
    ratio = float(sample_ratio)
    if not 0.0 < ratio <= 1.0:
        invalid(f"sample_ratio must be in (0, 1], got {sample_ratio}")
    return ratio


# ---------------------------------------------------------------------------
# Pure-TensorFlow references.

def _flat_v(x, residual, checks):
    checks.require(tf.reduce_all(tf.equal(tf.shape(x, out_type=tf.int64),
                                          tf.shape(residual, out_type=tf.int64))),
                   "x and residual must have the same shape")
    checks.require(tf.size(x, out_type=tf.int64) <= MAX_ELEMENTS,
                   f"x has more than {MAX_ELEMENTS} elements (int32 indices)")
    with tf.control_dependencies(checks.asserts):
        return tf.reshape(x + residual, [-1])


def _rank_keys(v_flat):
    """float32 ranking keys: |v|, NaN -> -1 (below every magnitude)."""
    vf = tf.cast(v_flat, tf.float32)
    return tf.where(tf.math.is_nan(vf), -tf.ones_like(vf), tf.abs(vf))


def _top_indices(keys, k):
    """Ascending indices of the k largest keys, ties to the lower index."""
    # tf.math.top_k puts the lower index first among equal values.
    _, idx = tf.math.top_k(keys, tf.cast(k, tf.int32), sorted=True)
    return tf.sort(idx)


def _finish(x, v_flat, idx, with_mask):
    n = tf.size(v_flat, out_type=tf.int32)
    idx = tf.cast(idx, tf.int32)
    pos = tf.reshape(idx, [-1, 1])
    values = tf.gather(v_flat, idx)
    new_residual = tf.tensor_scatter_nd_update(v_flat, pos, tf.zeros_like(values))
    if with_mask:
        mask = tf.scatter_nd(pos, tf.ones_like(idx, tf.bool), tf.reshape(n, [1]))
    else:
        mask = tf.zeros([0], tf.bool)
    return Sparsified(values, idx, tf.reshape(new_residual, tf.shape(x)), mask)


def _sampled_indices(keys, k, n, sample_ratio, seed):
    """DGC selection (see the module docstring) on float32 keys; k in (0, n)."""
    nf = tf.cast(n, tf.float64)
    kf = tf.cast(k, tf.float64)
    s = tf.maximum(tf.cast(tf.math.ceil(sample_ratio * nf), tf.int64),
                   tf.minimum(n, _MIN_SAMPLE))
    s = tf.minimum(s, n)
    pos = tf.random.stateless_uniform(
        tf.reshape(s, [1]), seed=tf.stack([seed, tf.zeros([], tf.int64)]),
        minval=0, maxval=n, dtype=tf.int64)
    sample = tf.gather(keys, pos)
    q = tf.clip_by_value(tf.cast(tf.round(kf * tf.cast(s, tf.float64) / nf), tf.int64), 1, s)
    thr = tf.math.top_k(sample, tf.cast(q, tf.int32)).values[-1]
    lo = tf.maximum(tf.cast(tf.math.ceil(_MIN_FRACTION * kf), tf.int64), 1)
    hi = tf.maximum(k, tf.cast(tf.math.floor(_MAX_FRACTION * kf), tf.int64))

    def count(t):
        return tf.reduce_sum(tf.cast(keys >= t, tf.int64))

    def cond(t, c, tries):
        return tf.logical_and(c < lo, tries < _MAX_LOWERINGS)

    def body(t, c, tries):
        t = t * _LOWER_FACTOR
        return t, count(t), tries + 1

    thr, cnt, _ = tf.while_loop(cond, body, (thr, count(thr), tf.constant(0)))

    def exact():
        return _top_indices(keys, k)

    def refine():  # exact top k among the selected ones
        return _top_indices(tf.where(keys >= thr, keys, -2 * tf.ones_like(keys)), k)

    def accept():
        return tf.cast(tf.reshape(tf.where(keys >= thr), [-1]), tf.int32)

    return tf.case([(cnt < lo, exact), (cnt > hi, refine)], default=accept)


def sparsify_with_residual_reference(x, residual, k, *, exact=False, sample_ratio=0.01,
                                     seed=0, with_mask=False):
    """Reference for :func:`sparsify_with_residual`."""
    x, residual = _selection_inputs(x, residual)
    k = int64_scalar(k, "k")
    seed = int64_scalar(seed, "seed")
    ratio = _sample_ratio(sample_ratio)
    checks = Checks()
    checks.require(k >= 0, "k must be >= 0")
    v = _flat_v(x, residual, checks)
    keys = _rank_keys(v)
    n = tf.size(v, out_type=tf.int64)
    kk = tf.minimum(k, n)
    if exact:
        idx = _top_indices(keys, kk)
    else:
        idx = tf.cond(
            tf.logical_or(tf.equal(kk, 0), tf.equal(kk, n)),
            lambda: _top_indices(keys, kk),
            lambda: _sampled_indices(keys, kk, n, ratio, seed))
    return _finish(x, v, idx, with_mask)


def sparsify_by_threshold_reference(x, residual, pos_threshold, neg_threshold, *,
                                    with_mask=False):
    """Reference for :func:`sparsify_by_threshold`."""
    x, residual = _selection_inputs(x, residual)
    pos = float32_scalar(pos_threshold, "pos_threshold")
    neg = float32_scalar(neg_threshold, "neg_threshold")
    checks = Checks()
    checks.require(tf.logical_and(pos >= 0, neg <= 0),
                   "need pos_threshold >= 0 >= neg_threshold")
    v = _flat_v(x, residual, checks)
    vf = tf.cast(v, tf.float32)
    selected = tf.logical_or(vf >= pos, vf <= neg)  # False for NaN
    idx = tf.cast(tf.reshape(tf.where(selected), [-1]), tf.int32)
    return _finish(x, v, idx, with_mask)


def _payload_inputs(values, indices, num_elements):
    values = float_tensor(values, "values")
    try:
        indices = to_tensor(indices, tf.int32)
    except (TypeError, ValueError, OverflowError) as exc:
        invalid(f"indices must be an int32 tensor: {exc}")
    if indices.dtype != tf.int32:
        invalid(f"indices must be int32, got {indices.dtype.name}")
    n = int64_scalar(num_elements, "num_elements")
    return values, indices, n


def scatter_add_payloads_reference(values, indices, num_elements):
    """Reference for :func:`scatter_add_payloads`."""
    values, indices, n = _payload_inputs(values, indices, num_elements)
    checks = Checks()
    checks.require_rank(values, 1, "values")
    checks.require_rank(indices, 1, "indices")
    checks.require(tf.equal(tf.size(values), tf.size(indices)),
                   "values and indices must have the same length")
    checks.require(tf.logical_and(n >= 0, n <= MAX_ELEMENTS),
                   f"num_elements must be in [0, {MAX_ELEMENTS}]")
    idx64 = tf.cast(indices, tf.int64)
    checks.require(tf.reduce_all(tf.logical_and(idx64 >= 0, idx64 < n)),
                   "every index must be in [0, num_elements)")
    with tf.control_dependencies(checks.asserts):
        # The CPU segment sum adds in input order; float32 for half types.
        dense = tf.math.unsorted_segment_sum(
            tf.cast(tf.reshape(values, [-1]), tf.float32), tf.reshape(indices, [-1]), n)
        return tf.cast(dense, values.dtype)


# ---------------------------------------------------------------------------
# Public dispatching API.

def sparsify_with_residual(x, residual, k, *, exact=False, sample_ratio=0.01, seed=0,
                           with_mask=False):
    """Top-k sparsification of ``v = x + residual`` with error feedback.

    Args:
      x: float32/float16/bfloat16 tensor (any shape, at most 2**31 elements).
      residual: the residual carried over, same shape and dtype as ``x``.
      k: int scalar >= 0, entries to send (``k >= n`` sends everything).
      exact: exactly ``min(k, n)`` largest ``|v|``; otherwise Deep Gradient
        Compression's sampled threshold (module docstring), which sends between
        ``ceil(0.8 k)`` and ``max(k, floor(1.3 k))`` entries and is several
        times faster.
      sample_ratio: fraction of ``v`` sampled to estimate the threshold, in
        ``(0, 1]`` (at least 256 entries are sampled).
      seed: int scalar making the sample deterministic.
      with_mask: also return the bool ``[n]`` mask of sent entries.

    Returns:
      ``Sparsified(values, indices, new_residual, mask)``: the sent entries of
      ``v`` and their ascending int32 flat indices, ``v`` with those entries
      zeroed (shape of ``x``), and the mask (``[0]`` unless ``with_mask``).

    Raises:
      tf.errors.InvalidArgumentError: mismatched shapes or dtypes, ``k < 0``,
        ``sample_ratio`` outside ``(0, 1]``, or more than 2**31 elements.
    """
    x, residual = _selection_inputs(x, residual)
    k = int64_scalar(k, "k")
    seed = int64_scalar(seed, "seed")
    ratio = _sample_ratio(sample_ratio)
    lib = _loader.load_library()
    if lib is None:
        return sparsify_with_residual_reference(
            x, residual, k, exact=exact, sample_ratio=ratio, seed=seed, with_mask=with_mask)
    return Sparsified(*lib.tfgc_sparsify_with_residual(
        x, residual, k, seed, exact=bool(exact), sample_ratio=ratio, with_mask=bool(with_mask)))


def sparsify_by_threshold(x, residual, pos_threshold, neg_threshold, *, with_mask=False):
    """Sends the entries of ``v = x + residual`` outside ``(neg, pos)``.

    Selects ``v >= pos_threshold`` or ``v <= neg_threshold``, compared in
    float32 (NaN is never sent). One global threshold (``neg = -pos``) or
    separate positive and negative ones (Dryden et al. 2016) are both covered.
    Requires ``pos_threshold >= 0 >= neg_threshold``, else
    ``tf.errors.InvalidArgumentError``. Returns ``Sparsified`` like
    :func:`sparsify_with_residual`.
    """
    x, residual = _selection_inputs(x, residual)
    pos = float32_scalar(pos_threshold, "pos_threshold")
    neg = float32_scalar(neg_threshold, "neg_threshold")
    lib = _loader.load_library()
    if lib is None:
        return sparsify_by_threshold_reference(x, residual, pos, neg, with_mask=with_mask)
    return Sparsified(*lib.tfgc_sparsify_by_threshold(x, residual, pos, neg,
                                                      with_mask=bool(with_mask)))


def scatter_add_payloads(values, indices, num_elements):
    """Decodes ``(values, indices)`` into a dense ``[num_elements]`` tensor.

    ``dense[i] = sum(values[j] for j with indices[j] == i)``, added in order
    of ``j`` (float32 accumulation for half types, rounded once), so the
    result is deterministic. ``values`` (float) and ``indices`` (int32) must be
    1-D of equal length, every index in ``[0, num_elements)`` and
    ``num_elements`` a scalar in ``[0, 2**31]``; otherwise
    ``tf.errors.InvalidArgumentError`` is raised.
    """
    values, indices, n = _payload_inputs(values, indices, num_elements)
    lib = _loader.load_library()
    if lib is None:
        return scatter_add_payloads_reference(values, indices, n)
    return lib.tfgc_scatter_add_payloads(values, indices, n)
