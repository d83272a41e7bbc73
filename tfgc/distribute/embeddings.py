"""Embedding gradients (``tf.IndexedSlices``): compressed rows, a dense table, or stock.

An embedding's gradient names the m rows of the table a batch touched (values
[m, ...], one index per row, repeated tokens repeated) and is summed by the stock
strategy with an all-gather of values and indices. In a language model it is the
largest gradient, and m changes with the batch: under Keras its static shape is
[None, ...] whatever the dataset. Each compressor's embedding gradients take one of
three modes (``mode``):

* ``ROWS``, compressors whose payload is a function of the values alone and whose
  combination is the sum of the decoded payloads (QSGD, TernGrad, the casts, random-k
  and FFT without error feedback): the rows are cut into blocks of a fixed number
  of rows, each block is compressed as a [rows, row size] matrix, and the blocks and
  their row indices are all-gathered, padded to the largest count among the workers
  (counts and the guard's control words go first, in an all-gather of their own). A
  worker's repeated rows are added before they are compressed, so it never sends
  more rows than the table has. Every worker decodes every worker's blocks, drops
  the padding and returns the rows in rank order: an IndexedSlices like the stock
  one, its rows quantized.
* ``DENSE``, compressors with state (error feedback, so 1-bit SGD and EF-signSGD
  too, DGC, PowerSGD, the thresholds), those that pick entries by size (top-k,
  importance, gradient dropping) and signSGD's vote: the rows are summed into a dense
  gradient of the table's shape, which joins the other gradients on the reduction
  path. Its state is a tensor of the table's shape, so every row keeps its residual
  (or momentum) from step to step, also while the batch does not touch it, and the
  sparsifiers choose among all the rows' entries.
* under ``auto``, per table, whichever its plan prices faster
  (``planner.plan_tables``): ``ROWS`` with the quantizer its plan sends most of the
  dense gradients' elements with, or, where it quantizes none but sends some
  low-rank, the quantizer of the fewest bytes within its error budget
  (``planner.row_candidate``; the stock gather when it plans everything as float32),
  or ``DENSE``, planned as any other gradient (low-rank among its options). The
  first plan, before a step has counted the rows, sends every table as rows, so only
  a later one (``AutoPlanCallback``'s) sends a table dense; worker 0 keeps a recent
  step's rows densified so that the low-rank measurement prices the table dense too;
* ``STOCK``: ``none`` (bit-identical to the stock strategy), variance-based
  compression (no second moment for an embedding), and tables the policy or the
  compressor does not take (GradiVeQ compresses convolutions only, unless
  ``dense_layers``): the stock gather.
"""

from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tfgc import collectives
from tfgc.collectives.allgather import num_payload_words, payload_words, unpack_payload_words
from tfgc.compressors import CompressContext
from tfgc.distribute.paths import guard

STOCK, ROWS, DENSE = "stock", "rows", "dense"
# Entries per block of rows: a few blocks for a batch of a few thousand tokens (each is
# one iteration of the encode and decode loops) and little padding (at most one block
# less a row per worker).
BLOCK_ENTRIES = 4096
# Context indices of the blocks: apart from the dense gradients' (0, 1, ...), so that a
# seeded compressor draws other numbers for them.
_INDEX_BASE = 1 << 20
# Block numbers folded into the step for the seeds: distinct up to this many blocks.
_BLOCKS_PER_STEP = 1 << 16


def row_size(variable) -> int:
    return int(np.prod(tf.TensorShape(variable.shape)[1:].as_list(), dtype=np.int64))


def block_rows(variable) -> int:
    """Rows per block for ``variable``'s table."""
    return block_rows_of(variable.shape)


def block_rows_of(shape) -> int:
    """Rows per block for a table of ``shape``."""
    size = int(np.prod(tf.TensorShape(shape)[1:].as_list(), dtype=np.int64))
    return max(1, BLOCK_ENTRIES // max(size, 1))


def _stateless(compressor, shape, dtype) -> bool:
    return not tf.nest.flatten(compressor.init_state(shape, dtype))


def takes_rows(compressor, variable, dtype) -> bool:
    """Whether ``compressor`` can send this table's gradient as compressed rows."""
    shape = tf.TensorShape([block_rows(variable), row_size(variable)])
    return (compressor.combines_by_sum and not compressor.needs_weights
            and not compressor.stages() and not compressor.fuses_gradients
            and compressor.index_selection is None and compressor.sparse_entries is None
            and compressor.low_rank is None and _stateless(compressor, shape, dtype)
            and compressor.supports(shape, dtype))


def _stock_cause(compressor, policy, variable, dtype) -> Optional[str]:
    """Why the gradient of the embedding ``variable`` takes the stock gather, or None."""
    if compressor.reduces_as_stock:
        return f"compressor {compressor.name}"
    if compressor.needs_second_moment:
        return f"{compressor.name} needs per-sample second moments"
    shape = tf.TensorShape(variable.shape)
    if not shape.is_fully_defined() or shape.rank < 1 or shape[0] >= 2 ** 31:
        return "table shape"
    return policy.reason(tf.TensorSpec(shape, dtype), compressor)


def mode(compressor, policy, variable, dtype) -> str:
    """How the gradient of the embedding ``variable`` (values of ``dtype``) travels."""
    if _stock_cause(compressor, policy, variable, dtype) is not None:
        return STOCK
    return ROWS if takes_rows(compressor, variable, dtype) else DENSE


def stock_reason(compressor, policy, variable, dtype) -> str:
    """Why the gradient of the embedding ``variable`` takes the stock gather (``STOCK``)."""
    if compressor.reduces_as_stock:
        return f"compressor {compressor.name}"
    return ("embedding rows on the stock gather: "
            + _stock_cause(compressor, policy, variable, dtype))


def densify(slices: tf.IndexedSlices, variable) -> tf.Tensor:
    """The dense gradient of ``variable`` that ``slices`` stand for (repeated rows added)."""
    shape = tf.TensorShape(variable.shape)
    values = tf.reshape(slices.values, [-1] + shape[1:].as_list())
    return tf.ensure_shape(
        tf.math.unsorted_segment_sum(values, slices.indices, shape[0]), shape)


def payload_like(compressor, shape, dtype, n):
    """The TensorSpecs of ``compressor``'s payload for a block of ``shape``."""
    with tf.Graph().as_default():
        ctx = CompressContext(rank=0, num_workers=n, index=_INDEX_BASE,
                              step=tf.constant(0, tf.int64))
        payload, _ = compressor.compress(tf.zeros(shape, dtype), {}, ctx)
        return [tf.TensorSpec(t.shape, t.dtype) for t in payload]


def _graph_only(fn):
    """``fn`` for ``tf.map_fn`` as it is. Inside Keras' autograph-converted train
    function, map_fn would otherwise convert the compressor's code, which is graph code
    already, the first time each compressor is traced: 24 steps of a small Transformer
    under QSGD on 2 workers took 3.6-4.7 s instead of 5.5-6.2 s in a fresh process."""
    return tf.autograph.experimental.do_not_convert(fn)


def reduce_rows(compressor, slices: Sequence[tf.IndexedSlices], variables, step, launcher,
                rank: int, num_workers: int, options, wire) -> tuple:
    """Every worker's rows of each of ``slices``, compressed (``ROWS``, module docstring).

    ``step`` (an int64 scalar, the same on every worker) seeds the compressor's draws
    and is checked by the guard. Returns ``(outputs, ok)``: one IndexedSlices per
    entry of ``slices``, their values NaN everywhere when some worker's rows were not
    finite or the workers' steps differ, and ``ok``.
    """
    n = num_workers
    plans = []
    for j, (s, var) in enumerate(zip(slices, variables)):
        d, r = row_size(var), block_rows(var)
        dtype = s.values.dtype
        # Repeated rows (a token seen twice) are added first: at most one row per
        # entry of the table, however large the batch.
        unique, position = tf.unique(tf.cast(s.indices, tf.int32))
        m = tf.shape(unique)[0]
        values = tf.math.unsorted_segment_sum(tf.reshape(s.values, [-1, d]), position, m)
        blocks = (m + r - 1) // r
        padded = tf.pad(values, [[0, blocks * r - m], [0, 0]])
        like = payload_like(compressor, [r, d], dtype, n)
        width = num_payload_words(like)

        def encode(args, j=j):
            block, b = args
            ctx = CompressContext(rank=rank, num_workers=n, index=_INDEX_BASE + j,
                                  step=step * _BLOCKS_PER_STEP + tf.cast(b, tf.int64))
            payload, _ = compressor.compress(block, {}, ctx)
            return payload_words(payload)

        words = tf.map_fn(_graph_only(encode),
                          (tf.reshape(padded, [-1, r, d]), tf.range(blocks)),
                          fn_output_signature=tf.TensorSpec([width], tf.int32))
        indices = tf.reshape(tf.pad(unique, [[0, blocks * r - m]]), [-1, r])
        plans.append(dict(d=d, r=r, m=m, blocks=blocks, like=like, width=width,
                          rows=tf.concat([words, indices], 1), dtype=dtype))

    # First the row counts and the control words, then the blocks padded to the
    # largest count.
    control = guard.control_words(guard.local_bad([s.values for s in slices]), step, tf.int32)
    head = tf.concat([tf.stack([p["m"] for p in plans]), control], 0)
    heads = tf.reshape(collectives.all_gather(launcher, head, options), [n, -1])
    wire.gather(4 * int(head.shape[0]))
    counts = heads[:, :len(plans)]
    ok = guard.ok(heads[:, len(plans):], n, step)

    buffers, sizes, own = [], [], []
    for j, p in enumerate(plans):
        most = tf.maximum(tf.reduce_max((counts[:, j] + p["r"] - 1) // p["r"]), 1)
        p["most"] = most
        rows = tf.pad(p["rows"], [[0, most - p["blocks"]], [0, 0]])
        buffers.append(tf.reshape(rows, [-1]))
        sizes.append(most * (p["width"] + p["r"]))
        own.append(tf.cast(4 * p["blocks"] * (p["width"] + p["r"]), tf.int64))
    buffer = tf.concat(buffers, 0) if len(buffers) > 1 else buffers[0]
    gathered = tf.reshape(collectives.all_gather(launcher, buffer, options), [n, -1])
    total = tf.cast(4 * tf.add_n(sizes), tf.int64)
    wire.at_run_time(dense=sum(int(np.prod(v.shape)) * s.values.dtype.size
                               for s, v in zip(slices, variables)),
                     payload=tf.add_n(own), sent=(n - 1) * total)
    parts = tf.split(gathered, tf.stack(sizes), axis=1) if len(plans) > 1 else [gathered]

    outputs = []
    for j, (s, p, part) in enumerate(zip(slices, plans, parts)):
        r, d, width, like = p["r"], p["d"], p["width"], p["like"]
        part = tf.reshape(part, [-1, width + r])

        def decode(args, like=like, r=r, d=d, dtype=p["dtype"], j=j):
            # Each worker's block b was encoded under the step and b (a rotation's
            # signs are drawn from them): decoded under the same.
            words, b = args
            ctx = CompressContext(rank=rank, num_workers=n, index=_INDEX_BASE + j,
                                  step=step * _BLOCKS_PER_STEP + tf.cast(b, tf.int64))
            return compressor.decompress(unpack_payload_words(words, like), tf.TensorShape(
                [r, d]), dtype, ctx)

        block_of = tf.range(tf.shape(part)[0]) % p["most"]  # n workers' ``most`` blocks
        values = tf.map_fn(_graph_only(decode), (part[:, :width], block_of),
                           fn_output_signature=tf.TensorSpec([r, d], p["dtype"]))
        # Worker w's rows are the first counts[w] of its most * r.
        valid = tf.reshape(tf.range(p["most"] * r)[None, :] < counts[:, j][:, None], [-1])
        values = tf.boolean_mask(tf.reshape(values, [-1, d]), valid)
        indices = tf.boolean_mask(tf.reshape(part[:, width:], [-1]), valid)
        values = tf.where(ok, values, tf.constant(float("nan"), values.dtype))
        values = tf.reshape(values, tf.concat([[-1], tf.shape(s.values)[1:]], 0))
        outputs.append(tf.IndexedSlices(tf.ensure_shape(values, [None] + s.values.shape[1:]),
                                        tf.cast(indices, s.indices.dtype), s.dense_shape))
    return outputs, ok
