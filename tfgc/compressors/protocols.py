"""The interfaces a reduction path may ask a compressor for, beyond compress/decompress.

A path never tests a compressor's class. It asks for the part it needs by name:

* ``compressor.error_feedback``: the error-feedback pair, or None. The shared-index
  path and the reduce-scatter keep the residual themselves; they take the momentum
  correction (``corrected``), the inner compressor (``inner``, whose
  ``compress_with_feedback`` returns v - decode) and the state's ``"residual"`` entry
  from it. ``ErrorFeedback`` is the one implementation.
* ``compressor.shared_scale``: the scaler-sharing quantizer, or None. On the
  reduce-scatter the workers first agree on one scaler, then a chunk's owner adds the
  codes as integers (``clipped``, ``compress_scaled``, ``count_payload_words``,
  ``sum_codes``, ``decode_counts``). TernGrad is the one implementation.

The other capabilities are still flags on ``Compressor`` that the paths' ``accepts``
read (``selects_indices`` with ``select_indices``/``num_selected``, ``sparse_payload``,
``recompressible`` with ``chunk_layout``/``recompress``, ``low_rank`` with
``matrix``/``query``). The classes below say what each named part provides, for
readers and type checkers.
"""

from typing import Any, Dict, Protocol, Sequence, Tuple


class ErrorFeedbackPair(Protocol):
    """What ``compressor.error_feedback`` returns (``tfgc.compressors.ErrorFeedback``)."""

    inner: Any
    momentum: float

    def corrected(self, x, state: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
        """Momentum correction: (what to compress, the new state entries)."""


class SharedScale(Protocol):
    """What ``compressor.shared_scale`` returns (``tfgc.compressors.TernGrad``)."""

    def clipped(self, x): ...

    def compress_scaled(self, g, scale, ctx): ...

    def count_payload_words(self, shape, num_workers: int) -> int: ...

    def sum_codes(self, payloads: Sequence, shape): ...

    def decode_counts(self, payload, shape, dtype, num_workers: int): ...
