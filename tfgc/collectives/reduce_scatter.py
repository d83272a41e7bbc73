"""The two collectives of the quantized reduce-scatter / all-gather.

The scheme is 1-bit SGD's (Seide et al. 2014, each node owns 1/K of the
parameters), as in LBANN and DeepSpeed's compressed all-reduce: every worker owns
one contiguous chunk of each gradient. Stage 1 sends every other worker its chunk,
compressed; the owner decodes the N chunks it holds, sums them and compresses the
sum again. Stage 2 all-gathers the owners' compressed sums. Each worker sends
(N-1)/N of a compressed gradient per stage, 2(N-1)/N in all, as a ring all-reduce
of the compressed size: flat in N, where an all-gather of whole payloads sends N-1
of them.

TensorFlow's CPU collectives have no all-to-all, so stage 1 is N-1 rounds of
pairwise exchanges (``PairExchanger``), scheduled as a round-robin tournament:
partner ``rank ^ r`` in round r when N is a power of two (the butterfly's
pattern), the circle method otherwise (N rounds for odd N, each worker sitting
one out). Every worker meets every other exactly once and each round pairs
workers off, so the exchanges complete in any order the runtime runs them.
Stage 2 is the group's own all-gather (a ring on CPU, NCCL on GPU).

Each element is compressed once per stage: the error does not compound over hops,
and signSGD's owner sees all N votes, so its majority is the paper's.
"""

from typing import Dict, List, NamedTuple, Optional, Tuple

import tensorflow as tf

from tfgc.collectives.allgather import all_gather
from tfgc.collectives.pairwise import PairExchanger


def pair_rounds(num_ranks: int) -> List[Dict[int, int]]:
    """Rounds of a round-robin tournament: in each, ``{rank: partner}`` for the ranks that play."""
    n = num_ranks
    if n < 2:
        return []
    if n & (n - 1) == 0:
        return [{r: r ^ s for r in range(n)} for s in range(1, n)]
    m = n + (n % 2)  # an even number of players; player n (if any) is the bye
    rounds = []
    for r in range(m - 1):
        pairs = [(m - 1, r)] + [((r + i) % (m - 1), (r - i) % (m - 1)) for i in range(1, m // 2)]
        matching = {}
        for a, b in pairs:
            if a < n and b < n:
                matching[a], matching[b] = b, a
        rounds.append(matching)
    return rounds


def chunk_bounds(num_elements: int, unit: int, num_ranks: int) -> List[Tuple[int, int]]:
    """``[start, end)`` of each rank's chunk: contiguous, cut at multiples of ``unit``.

    Units are dealt as evenly as possible (the first ``units % N`` chunks get one
    more); the last chunk ends at ``num_elements``. Needs at least ``num_ranks`` units.
    """
    units = -(-num_elements // unit)
    if units < num_ranks:
        raise ValueError(f"{num_elements} elements in units of {unit} cannot be cut into "
                         f"{num_ranks} chunks")
    base, extra = divmod(units, num_ranks)
    bounds, start = [], 0
    for r in range(num_ranks):
        end = min(num_elements, start + (base + (r < extra)) * unit)
        bounds.append((start, end))
        start = end
    return bounds


class ChunkPlan(NamedTuple):
    """How a gradient is cut into one chunk per rank.

    The gradient is viewed as a ``view`` = [rows, cols] matrix and cut along
    ``axis`` into contiguous ranges, ``chunks[r]`` = (start, end, chunk shape).
    """

    view: Tuple[int, int]
    axis: int
    chunks: List[Tuple[int, int, tf.TensorShape]]

    @property
    def _contiguous(self) -> bool:
        # Row blocks, and ranges of a flat view, are contiguous in memory: they are
        # cut from the flat tensor, which TensorFlow slices without copying.
        return self.axis == 0 or self.view[0] == 1

    def _flat_range(self, rank: int):
        a, b, _ = self.chunks[rank]
        stride = self.view[1] if self.axis == 0 else 1
        return a * stride, b * stride

    def take(self, x, rank: int):
        """Rank ``rank``'s chunk of ``x`` (any tensor of the gradient's size)."""
        a, b, chunk = self.chunks[rank]
        if self._contiguous:
            start, end = self._flat_range(rank)
            return tf.reshape(tf.reshape(x, [-1])[start:end], chunk)
        return tf.reshape(x, self.view)[:, a:b]

    def join(self, parts, shape):
        """The gradient of ``shape`` from its chunks, in rank order."""
        if self._contiguous:
            return tf.reshape(tf.concat([tf.reshape(p, [-1]) for p in parts], 0), shape)
        parts = [tf.reshape(p, c) for p, (_, _, c) in zip(parts, self.chunks)]
        return tf.reshape(tf.concat(parts, 1), shape)


def chunk_plan(layout, shape: tf.TensorShape, num_ranks: int) -> ChunkPlan:
    """Each rank's chunk of a gradient of ``shape``, from a compressor's ``layout``.

    ``layout`` is ``(view, axis, unit)``, what ``Compressor.chunk_layout`` returns:
    the gradient viewed as a [rows, cols] ``view``, cut along ``axis``. The cut
    falls at multiples of ``unit`` (whole buckets for QSGD), or anywhere when there
    are fewer units than ranks; a gradient too narrow to cut along its axis is cut
    per element, as one column.
    """
    total = shape.num_elements()
    view, axis, unit = layout
    if view[axis] < num_ranks:
        view, axis, unit = (total, 1), 0, 1
    length = view[axis]
    if -(-length // unit) < num_ranks:
        unit = 1
    chunks = []
    for a, b in chunk_bounds(length, unit, num_ranks):
        chunk = [view[0], b - a] if axis == 1 else [b - a, view[1]]
        chunks.append((a, b, tf.TensorShape(chunk)))
    return ChunkPlan(tuple(view), axis, chunks)


def scatter_to_owners(ex: PairExchanger, num_ranks: int,
                      outgoing: Dict[int, tf.Tensor]) -> Dict[int, tf.Tensor]:
    """Stage 1: sends ``outgoing[p]`` to each other rank p; returns what each sent here.

    Every message of one call has the same static length (the sender pads), so a
    pair's two sides always agree on the shape of their exchange.
    """
    received = {}
    for matching in pair_rounds(num_ranks):
        partner = matching.get(ex.rank)
        if partner is not None:
            received[partner] = ex.exchange(partner, outgoing[partner])
    return received


def gather_from_owners(launcher, words: tf.Tensor, num_ranks: int, options,
                       control: Optional[tf.Tensor] = None):
    """Stage 2: all-gathers each owner's words (and control words); ``[N, len]`` each."""
    length = int(words.shape[0])
    parts = [words] if control is None else [words, tf.reshape(control, [-1])]
    buffer = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
    gathered = tf.reshape(all_gather(launcher, buffer, options), [num_ranks, int(buffer.shape[0])])
    return gathered[:, :length], (gathered[:, length:] if control is not None else None)
