"""The parts a reduction path may ask a compressor for, beyond compress/decompress.

A path never tests a compressor's class or a flag. It asks for the part it needs by
name; ``Compressor`` offers none (each is None), and a compressor that implements one
returns the object that does (usually itself):

* ``error_feedback``: the error-feedback pair. The shared-index path and the
  reduce-scatter keep the residual themselves; they take the momentum correction
  (``corrected``), the inner compressor (``inner``, whose ``compress_with_feedback``
  returns v - decode) and the state's ``"residual"`` entry from it. ``ErrorFeedback``.
* ``shared_scale``: on the reduce-scatter the workers first agree on one scaler,
  then a chunk's owner adds the codes as integers. ``TernGrad``.
* ``index_selection``: one worker's index set can serve every worker (the
  shared-index all-reduce). ``TopK``, ``Importance``; not DGC, whose index set is
  its own worker's by construction.
* ``sparse_entries``: the payload is (values, int32 flat indices), which the sparse
  all-reduce merges stage by stage. ``TopK`` and DGC, gradient dropping unquantized.
* ``chunk_recompression``: a chunk's owner can compress the chunk's decoded sum
  again (stateless, static payload shapes): the two-stage reduce-scatter. The
  quantizers.
* ``low_rank``: factors all-reduced in turn (``communication="low_rank"``), the
  rounds of ``tfgc/distribute/paths/low_rank.py``. ``PowerSGD``.

The last four describe the payload, so an error-feedback wrapper offers its inner
compressor's (``WIRE_PARTS``); ``chunk_recompression`` only while the inner
compressor is stateless, since the owner's second compression keeps no state. The
classes below say what each part provides, for readers and type checkers.
"""

from typing import Any, Dict, Protocol, Sequence, Tuple

# The parts that describe the payload on the wire: an error-feedback wrapper offers
# its inner compressor's.
WIRE_PARTS = ("index_selection", "sparse_entries", "chunk_recompression", "low_rank")


class ErrorFeedbackPair(Protocol):
    """``compressor.error_feedback`` (``tfgc.compressors.ErrorFeedback``)."""

    inner: Any
    momentum: float

    def corrected(self, x, state: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
        """Momentum correction: (what to compress, the new state entries)."""


class SharedScale(Protocol):
    """``compressor.shared_scale`` (``tfgc.compressors.TernGrad``)."""

    def clipped(self, x): ...

    def compress_scaled(self, g, scale, ctx): ...

    def count_payload_words(self, shape, num_workers: int) -> int: ...

    def sum_codes(self, payloads: Sequence, shape): ...

    def decode_counts(self, payload, shape, dtype, num_workers: int): ...


class IndexSelection(Protocol):
    """``compressor.index_selection`` (``tfgc.compressors.TopK`` and ``Importance``)."""

    # Whether the method's paper aggregates over one worker's index set (Cheng & Xu's
    # importance-weighted pruning): auto then picks the shared-index all-reduce.
    shares_indices: bool

    def num_selected(self, shape) -> int:
        """How many indices ``select_indices`` returns for a gradient of ``shape``."""

    def select_indices(self, v, ctx):
        """The int32 flat indices this sparsifier would send for ``v``, static shape [k]."""


class SparseEntries(Protocol):
    """``compressor.sparse_entries`` (top-k, DGC, unquantized gradient dropping)."""

    def entries(self, payload) -> Tuple[Any, Any]:
        """The payload's (values, int32 flat indices), as many of each."""


class ChunkRecompression(Protocol):
    """``compressor.chunk_recompression`` (the quantizers)."""

    def chunk_layout(self, shape, num_ranks: int):
        """``(view, axis, unit)``: how the reduce-scatter cuts a gradient into chunks."""

    def recompress(self, x, ctx):
        """A chunk's sum over workers, compressed again by its owner: the payload."""


class LowRank(Protocol):
    """``compressor.low_rank`` (``tfgc.compressors.PowerSGD``)."""

    rank: int

    def matrix(self, x, residual):
        """The gradient plus residual as the matrix that is factorised."""

    def query(self, stored, ctx):
        """This step's query Q (the stored one, or a fresh one where it starts)."""
