"""How a reduction path's time grows with the cluster: an alpha-beta model.

For one gradient of ``e`` elements on ``N`` workers, a path costs

    alpha * hops(path, N) + beta * sent(path, N) + codec CPU(path, N)

* ``alpha``: seconds per hop, a message that cannot start before the previous one
  arrived (one step of a ring, one round of pairwise exchanges);
* ``beta``: seconds per byte a worker sends (its link's rate; a worker receives as
  much as it sends on every path here, and links are full duplex);
* the codec's CPU: the elements each worker encodes and decodes (``codec_calls``)
  times the seconds per element measured on this machine, and a fixed cost per call.

The paths, as tfgc runs them on TensorFlow's collectives (rings on CPU):

==================  ================  ================================  =======================
path                hops              bytes sent per worker             encoded / decoded
==================  ================  ================================  =======================
``allreduce``       2(N-1)            2(N-1)/N * dense (or cast) bytes  e / e (casts only)
``allgather``       N-1               (N-1) * payload                   e / N e (one call)
``reduce_scatter``  R(N) + N-1        2(N-1)/N * payload                (N+1)/N e / 2e
``low_rank``        4(N-1)            2(N-1)/N * payload                e / e
``shared_index``    4(N-1)            2(N-1)/N * payload                e / e
==================  ================  ================================  =======================

The last two are two ring all-reduces one after the other: PowerSGD's P then Q (its
payload: both factors), and the shared-index path's index set then the values at it
(its payload: both). The sparse all-reduce is left out: what its recursive doubling
sends depends on how much the workers' index sets overlap.

``R(N) = pair_rounds(N)`` is the reduce-scatter's first stage: a round-robin
tournament of pairwise exchanges, N-1 rounds for even N and N for odd N
(``tfgc.collectives.reduce_scatter.pair_rounds``); its second stage is a ring
all-gather of the owners' chunks. The rounds are counted one after the other, an
upper bound: nothing in the graph orders them, but on 8 workers the check measured
the reduce-scatter no faster than a ring all-reduce of as many hops.

What the model leaves out: the decoding of the all-gather is a dense codec's (one
fused sum of N payloads, QSGD's ``aggregate``); a sparse payload's sum is a
scatter-add of N k entries into e, which it over-charges, and a rotated sum is
rotated back once, where it charges N rotations. A group of several buckets (pieces
above ``overlap_bytes``) pays the hops per bucket; TernGrad's reduce-scatter adds an
all-gather of its scalers.

The model is what ``benchmarks/scaling.py`` checks against clusters of 2 to 8 workers
on shaped links and then uses for 16 to 1024 workers. The module's own code needs no
TensorFlow: the planner measures, this module only counts.
"""

import dataclasses

PATHS = ("allreduce", "allgather", "reduce_scatter", "low_rank", "shared_index")
# Paths of two ring all-reduces, one after the other.
_TWO_RINGS = ("low_rank", "shared_index")


def _check(path: str, num_workers: int):
    if path not in PATHS:
        raise ValueError(f"no cost model for path {path!r}; known: {', '.join(PATHS)}")
    if int(num_workers) != num_workers or num_workers < 1:
        raise ValueError(f"`num_workers` must be an integer >= 1, got {num_workers!r}")


def pair_rounds(num_workers: int) -> int:
    """Rounds of the reduce-scatter's pairwise exchanges: N-1 for even N, N for odd."""
    n = num_workers
    return 0 if n < 2 else n - 1 + n % 2


def hops(path: str, num_workers: int) -> int:
    """Messages one worker waits on one after the other for one bucket of ``path``."""
    _check(path, num_workers)
    n = num_workers
    if n < 2:
        return 0
    if path == "allreduce":
        return 2 * (n - 1)
    if path == "allgather":
        return n - 1
    if path in _TWO_RINGS:
        return 4 * (n - 1)
    return pair_rounds(n) + n - 1


def ring_sent(nbytes: float, num_workers: int) -> float:
    """Bytes each worker sends in a ring all-reduce of ``nbytes``."""
    return 2.0 * (num_workers - 1) / num_workers * nbytes


def sent(path: str, num_workers: int, nbytes: float) -> float:
    """Bytes one worker sends: ``nbytes`` is the vector an all-reduce sums (its dense
    or cast bytes), or one worker's whole compressed payload on the other paths."""
    _check(path, num_workers)
    n = num_workers
    if n < 2:
        return 0.0
    if path == "allgather":
        return (n - 1) * float(nbytes)
    return ring_sent(nbytes, n)  # all-reduces, and the reduce-scatter's two stages


def codec_calls(path: str, num_workers: int, elements: float):
    """The codec's calls per worker for a gradient of ``elements``: two lists of
    ``(count, elements)``, for the encodings and for the decodings.

    all-reduce (the casts), and the paths of two all-reduces: one encoding, one
    decoding of the sum; all-gather: one encoding, and the N workers' payloads summed
    in one call (``aggregate``: QSGD's is one fused kernel; a compressor without one
    decodes them one by one, which this leaves out); reduce-scatter: each of the N
    chunks encoded on its own, the owner's N payloads of its chunk summed in one call
    (QSGD's fused ``aggregate``), that sum encoded again, and the N owners' chunks of
    the all-gather decoded one by one.
    """
    _check(path, num_workers)
    n, e = num_workers, float(elements)
    if path == "allreduce" or path in _TWO_RINGS:
        return [(1, e)], [(1, e)]
    if path == "allgather":
        return [(1, e)], [(1, n * e)]
    return [(n + 1, e / n)], [(1, e), (n, e / n)]


def codec_seconds(path: str, num_workers: int, elements: float, encode, decode) -> float:
    """Seconds of the codec's calls (``codec_calls``), ``encode(e)`` and ``decode(e)``
    being the measured seconds of one call on ``e`` elements."""
    encodes, decodes = codec_calls(path, num_workers, elements)
    return (sum(count * encode(e) for count, e in encodes)
            + sum(count * decode(e) for count, e in decodes))


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """A link: ``alpha`` seconds per hop and ``beta`` seconds per byte sent."""

    alpha: float
    beta: float

    @classmethod
    def from_allreduce(cls, latency: float, seconds_per_byte: float,
                       num_workers: int) -> "AlphaBeta":
        """The link behind a ring all-reduce measured on ``num_workers`` as ``latency``
        (its time at zero bytes) plus ``seconds_per_byte`` of what each worker sent."""
        h = hops("allreduce", num_workers)
        return cls(latency / h if h else 0.0, seconds_per_byte)

    @classmethod
    def from_rate(cls, gbps: float, alpha_us: float) -> "AlphaBeta":
        if not gbps > 0 or not alpha_us >= 0:
            raise ValueError(f"need a rate > 0 Gbit/s and a latency >= 0 us, got "
                             f"{gbps!r} and {alpha_us!r}")
        return cls(alpha_us * 1e-6, 8.0 / (gbps * 1e9))

    def latency(self, path: str, num_workers: int) -> float:
        return self.alpha * hops(path, num_workers)

    def wire(self, path: str, num_workers: int, nbytes: float) -> float:
        return self.beta * sent(path, num_workers, nbytes)

    def time(self, path: str, num_workers: int, nbytes: float) -> float:
        """Latency and wire time of one bucket of ``nbytes`` (as ``sent`` reads it)."""
        return self.latency(path, num_workers) + self.wire(path, num_workers, nbytes)
