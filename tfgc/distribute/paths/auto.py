"""``communication="auto"``: the path that sends the fewest bytes, from the gradients' shapes.

Per worker and step, for payloads of P bytes in all (static shapes, so known when
the step is traced):

* all-reduce (summable payloads): 2(N-1)/N * P, the ring, never more than the
  all-gather, so summable compressors take it without a count;
* low-rank (PowerSGD): two ring all-reduces of the factors, 2(N-1)/N * P in all;
  its estimator needs the shared power iteration, so PowerSGD always takes it;
* all-gather: (N-1) * P;
* reduce-scatter / all-gather: (N-1) chunk payloads out in stage 1 and (N-1) in
  stage 2, each padded to the longest chunk, about 2(N-1)/N * P plus the per-chunk
  scales. It wins from N = 3 on; at N = 2 it ties with the all-gather on bytes and
  quantizes twice, so the all-gather is kept. Auto takes it only for compressors
  whose second stage needs no error feedback (``auto_reduce_scatter``).

Auto chooses among paths that compute the same estimator as the all-gather (or, for
the reduce-scatter, the paper's two-stage one). It picks the shared-index all-reduce
only for importance-weighted pruning, whose paper aggregates that way (for top-k it
changes what is selected), and never the sparse all-reduce, whose bytes
depend on how much the workers' index sets overlap and reach the all-gather's when
they do not; both are there to force.
"""

import functools
from typing import Dict, Sequence, Tuple

import tensorflow as tf

from tfgc.collectives.allgather import num_payload_words
from tfgc.collectives.reduce_scatter import chunk_plan
from tfgc.compressors import CompressContext
from tfgc.distribute.paths import guard

def _payload_words(compressor, shape: tf.TensorShape, dtype: tf.DType) -> int:
    """int32 words of one payload for a gradient of ``shape``, built in a scratch graph."""
    return _cached_words(compressor, tuple(shape.as_list()), dtype.name)


@functools.lru_cache(maxsize=4096)
def _cached_words(compressor, dims: Tuple[int, ...], dtype_name: str) -> int:
    shape, dtype = tf.TensorShape(dims), tf.as_dtype(dtype_name)
    with tf.Graph().as_default():
        payload, _ = compressor.compress(tf.zeros(shape, dtype),
                                         compressor.init_state(shape, dtype), CompressContext())
        return num_payload_words(payload)


def sent_bytes(path: str, compressor, gradients: Sequence[Tuple[tf.TensorShape, tf.DType]],
               num_ranks: int) -> int:
    """Bytes one worker sends per step on ``path`` ("allgather" or "reduce_scatter") for
    compressed gradients of these shapes."""
    n = num_ranks
    if n < 2:
        return 0
    if path == "reduce_scatter":
        layout = compressor.chunk_recompression.chunk_layout
        plans = [(chunk_plan(layout(tf.TensorShape(shape), n), tf.TensorShape(shape), n).chunks,
                  dtype) for shape, dtype in gradients]
        widths = sum(max(_payload_words(compressor, s, dtype) for _, _, s in plan)
                     for plan, dtype in plans)
        second, scalers = widths, 0
        if compressor.shared_scale is not None:
            # TernGrad: a gather of the shared scalers first, and exact sums of codes.
            second = sum(max(compressor.count_payload_words(s, n) for _, _, s in plan)
                         for plan, _ in plans)
            scalers = len(plans)
        # Stage 1 tags each exchange with the sender's rank; stage 2 carries the control.
        return (n - 1) * 4 * (scalers + widths + 1 + second + guard.CONTROL_WORDS)
    if path != "allgather":
        raise ValueError(f"no byte count for path {path!r}")
    words = sum(_payload_words(compressor, tf.TensorShape(shape), dtype)
                for shape, dtype in gradients)
    return (n - 1) * 4 * (words + guard.CONTROL_WORDS)


def auto_reduce_scatter(compressor) -> bool:
    """Whether auto may send ``compressor`` over the reduce-scatter.

    Where the second stage keeps the compressor's estimator: exact (signSGD's vote,
    TernGrad's sums of codes) or unbiased (QSGD); and error feedback with momentum
    correction (``onebit:momentum=0.9``), where the momentum is applied once, before
    both residuals. Error feedback under the optimizer's heavy-ball momentum is
    left on the all-gather: the owner's second residual delays more of every
    gradient, the optimizer's momentum amplifies every delayed part again, and that
    cost 9 points of accuracy for 1-bit SGD on 4 workers (see docs/results.md); it takes
    the reduce-scatter only when asked for.
    """
    if compressor.chunk_recompression is None:
        return False
    return compressor.error_feedback is None or bool(compressor.applied_momentum)


def choose_communication(compressor, num_ranks: int, gradients=None) -> Tuple[str, Dict[str, int]]:
    """Auto's path for ``compressor`` on ``num_ranks`` workers, and the bytes it compared.

    Without ``gradients`` (shapes and dtypes of the compressed gradients) the
    choice follows the rule the byte counts give for gradients of any size.
    """
    if compressor.summable:
        return "allreduce", {}
    if compressor.low_rank is not None:
        return "low_rank", {}
    if compressor.index_selection is not None and compressor.index_selection.shares_indices:
        return "shared_index", {}
    if not auto_reduce_scatter(compressor) or num_ranks < 3:
        return "allgather", {}
    if not gradients:
        return "reduce_scatter", {}
    figures = {path: sent_bytes(path, compressor, gradients, num_ranks)
               for path in ("allgather", "reduce_scatter")}
    return min(figures, key=lambda path: (figures[path], path != "allgather")), figures
