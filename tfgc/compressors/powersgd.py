"""PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019): rank-r power iteration with
a warm-started query and error feedback.

Each compressed gradient is viewed as a matrix M (n x m). Per step, on every worker
i, with residual e_i and the query Q (m x r) shared by all workers:

  1. M_i = g_i + e_i;
  2. P_i = M_i Q, and P = sum_i P_i (all-reduce);
  3. P^ = orthogonalize(P), the columns by Gram-Schmidt;
  4. Q_i = M_i^T P^, and Q = sum_i Q_i (all-reduce);
  5. the applied gradient is P^ Q^T = P^ P^T sum_i M_i (the sum over workers);
  6. e_i <- M_i - P^ Q^T / N: the worker's input less the *mean* reconstruction;
  7. the query of the next step is Q / N (warm start).

Both messages are linear in M given the shared Q and P^, so they are plain dense
all-reduces, r (n + m) floats per matrix, and their sums are what one worker would
compute from the sum of the M_i. This file holds steps 1 and 3 and the query
(``matrix``, ``orthogonalize``, ``query``); the two all-reduces, the residual and the
next query (steps 2 and 4-7) are the path ``tfgc/distribute/paths/low_rank.py``
(``communication="low_rank"``, which auto picks). Summed over workers, the residuals
and what was applied conserve every gradient: sum_t out_t + sum_i e_i = sum_t,i g_i.

Choices where the paper leaves room, taken from the authors' code (epfml/powersgd,
``paper-code/gradient_reducers.py``, ``RankKReducer``): Gram-Schmidt divides each
column by its norm plus 1e-8; the first query is i.i.d. N(0, 1) from a seed shared by
the workers (drawn again whenever the stored query is all zeros: at the start, after
a reset or after a migration); tensors with fewer than 2 dimensions, or whose
rank-r factors would not be ``min_compression_rate`` times smaller, go dense. Keras
kernels put the output units last, so the matrix view is [prod(shape[:-1]),
shape[-1]] (the PyTorch layout's transpose, which has the same rank-r
approximations). Momentum stays with the optimizer, after aggregation, as in the
paper. The library's ``start_compressing_after_num_steps`` is not offered.

On the all-gather path each worker compresses alone (its own P^ and Q, one power
iteration on its own M_i) and the decoded low-rank matrices are summed; that sends
N - 1 payloads instead of two all-reduces, so auto never chooses it.
"""

import tensorflow as tf

from tfgc.compressors.base import Compressor, as_columns, check_int

_EPS = 1e-8


def orthogonalize(p: tf.Tensor) -> tf.Tensor:
    """Orthonormal columns by modified Gram-Schmidt, each column divided by norm + 1e-8.

    The same input gives the same bits on every worker (a fixed sequence of ops).
    """
    cols = []
    rest = [p[:, j] for j in range(p.shape[1])]
    for j in range(len(rest)):
        col = rest[j]
        col = col / (tf.norm(col) + tf.cast(_EPS, col.dtype))
        cols.append(col)
        for k in range(j + 1, len(rest)):
            rest[k] = rest[k] - tf.reduce_sum(col * rest[k]) * col
    return tf.stack(cols, axis=1)


class PowerSGD(Compressor):
    """Rank-r PowerSGD with error feedback and a warm-started query.

    Args:
      rank: the rank r of the approximation, >= 1. Default 2 (the paper uses 1, 2
        and 4; rank 2 matched SGD's accuracy on CIFAR-10 with ResNet-18).
      warm_start: reuse the previous step's query (the paper's ``reuse_query``);
        False draws a fresh one every step.
      min_compression_rate: a matrix is compressed only when n m >= rate r (n + m);
        others are sent dense. >= 1, default 2 (the authors' library).
      seed: seed of the random queries, the same on every worker.

    Wire: r (n + m) floats per matrix, in two all-reduces per step.
    """

    name = "powersgd"
    keeps_residual = True
    shared_state = ("query",)  # drawn from a shared seed, then M^T P of the summed M

    @property
    def low_rank(self):
        """This compressor: its factors are all-reduced in turn (the low-rank path)."""
        return self

    def __init__(self, rank: int = 2, warm_start: bool = True, min_compression_rate: float = 2.0,
                 seed: int = 0):
        self.rank = check_int("rank", rank, 1)
        if not isinstance(warm_start, bool):
            raise ValueError(f"`warm_start` must be a bool, got {warm_start!r}")
        self.warm_start = warm_start
        if isinstance(min_compression_rate, bool) or not isinstance(
                min_compression_rate, (int, float)) or not 1.0 <= float(min_compression_rate) \
                < float("inf"):
            raise ValueError("`min_compression_rate` must be a finite number >= 1, got "
                             f"{min_compression_rate!r}")
        self.min_compression_rate = float(min_compression_rate)
        self.seed = check_int("seed", seed, 0)

    # -- shapes ------------------------------------------------------------------------

    @staticmethod
    def matrix_shape(shape):
        """The [n, m] view of a gradient of ``shape``: the last axis is m."""
        return as_columns(shape)

    def supports(self, shape, dtype):
        if not super().supports(shape, dtype) or shape.rank < 2:
            return False
        n, m = self.matrix_shape(shape)
        return n * m >= self.min_compression_rate * self.rank * (n + m)

    # -- state ---------------------------------------------------------------------------

    def init_state(self, shape, dtype):
        _, m = self.matrix_shape(shape)
        return {"residual": tf.zeros(shape, dtype), "query": tf.zeros([m, self.rank], dtype)}

    def query(self, stored: tf.Tensor, ctx) -> tf.Tensor:
        """This step's query: the stored one, or a fresh N(0, 1) draw shared by the
        workers when it is all zeros or ``warm_start`` is off."""
        def fresh():
            draw = tf.random.stateless_normal(stored.shape, ctx.seed(self.seed, shared=True))
            return tf.cast(draw, stored.dtype)

        if not self.warm_start:
            return fresh()
        # Drawn every step and picked where the stored one is all zeros: m x r draws
        # cost microseconds beside the m x n x r product, where a tf.cond per gradient
        # (two branch graphs) took a traced step of 56 matrices about a second longer
        # to trace (EfficientNetB0), which a change of plan under compressor="auto" pays.
        return tf.where(tf.reduce_all(tf.equal(stored, 0)), fresh(), stored)

    def matrix(self, x: tf.Tensor, residual: tf.Tensor) -> tf.Tensor:
        """M = x + residual as its [n, m] matrix."""
        return tf.reshape(x + residual, self.matrix_shape(x.shape))

    # -- one worker alone (the all-gather path) -----------------------------------------

    def compress(self, x, state, ctx):
        m = self.matrix(x, state["residual"])
        p = orthogonalize(tf.matmul(m, self.query(state["query"], ctx)))
        q = tf.matmul(m, p, transpose_a=True)
        approx = tf.matmul(p, q, transpose_b=True)
        return (p, q), {"residual": tf.reshape(m - approx, x.shape), "query": q}

    def decompress(self, payload, shape, dtype, ctx):
        p, q = payload
        return tf.cast(tf.reshape(tf.matmul(p, q, transpose_b=True), shape), dtype)

    def compress_with_feedback(self, x, residual, state, ctx):
        raise ValueError("powersgd keeps its own residual; use it without `ef+`")
