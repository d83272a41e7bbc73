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

from typing import Dict, List, Optional, Tuple

import tensorflow as tf

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


def chunk_plan(compressor, shape: tf.TensorShape,
               num_ranks: int) -> List[Tuple[int, int, tf.TensorShape]]:
    """Each rank's chunk of a gradient: ``(start, end, chunk shape)``.

    Chunks are cut at the compressor's ``chunk_unit`` (whole rows for 1-bit SGD,
    whole buckets for QSGD), or per element when there are fewer units than ranks.
    A chunk is shaped ``[rows, unit]`` so per-column quantizers see its columns.
    """
    total = shape.num_elements()
    unit = compressor.chunk_unit(shape)
    if -(-total // unit) < num_ranks:
        unit = 1
    plan = []
    for a, b in chunk_bounds(total, unit, num_ranks):
        length = b - a
        plan.append((a, b, tf.TensorShape([length // unit, unit] if length % unit == 0
                                          else [length, 1])))
    return plan


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
    gathered = tf.reshape(launcher._all_gather(buffer, options),  # pylint: disable=protected-access
                          [num_ranks, int(buffer.shape[0])])
    return gathered[:, :length], (gathered[:, length:] if control is not None else None)
