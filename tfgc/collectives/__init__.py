"""How payloads cross the wire, over TensorFlow's collective runtime.

Each function takes a ``CollectiveReplicaLauncher`` (one per local device, owned by
the cross-device ops), so every collective tfgc issues shares TensorFlow's instance
keys and ordering token: workers launch them in one order and cannot deadlock.
"""

from tfgc.collectives.allgather import gather_payloads
from tfgc.collectives.choice import choose_communication
from tfgc.collectives.dense import fused_all_reduce
from tfgc.collectives.pairwise import PairExchanger
from tfgc.collectives.reduce_scatter import (chunk_bounds, chunk_plan, gather_from_owners,
                                             pair_rounds, scatter_to_owners)
from tfgc.collectives.shared_index import share_root_indices
from tfgc.collectives.sparse_allreduce import sparse_all_reduce

# Communication schemes a compressed gradient can use. "allreduce" needs a
# summable payload; "allgather" works for any payload; "shared_index" needs a
# sparsifier that selects indices (one worker's index set serves all);
# "sparse_allreduce" needs a (values, indices) payload, merged stage by stage;
# "reduce_scatter" needs a quantizer whose decoded sum can be compressed again;
# "low_rank" (PowerSGD) all-reduces the two factors of a shared power iteration.
COMMUNICATIONS = ("auto", "allreduce", "allgather", "reduce_scatter", "shared_index",
                  "sparse_allreduce", "low_rank")


def check_communication(communication, compressor):
    """Refuses a communication scheme that cannot carry ``compressor``'s payloads."""
    if communication not in COMMUNICATIONS:
        raise ValueError(f"`communication` must be one of {COMMUNICATIONS}, got {communication!r}")
    if communication == "allreduce" and not compressor.summable:
        raise ValueError(
            f"`communication`='allreduce' needs a summable compressor, but {compressor!r} "
            "payloads do not add element-wise (they carry per-worker indices or scales); "
            "use 'allgather' or 'auto'")
    if communication == "shared_index" and not compressor.selects_indices:
        raise ValueError(
            f"`communication`='shared_index' needs a sparsifier that selects indices (topk, "
            f"ef+topk), got {compressor!r}")
    if communication == "sparse_allreduce" and not compressor.sparse_payload:
        raise ValueError(
            f"`communication`='sparse_allreduce' needs a sparsifier whose payload is (values, "
            f"indices) (topk, ef+topk), got {compressor!r}")
    if communication == "reduce_scatter" and not compressor.recompressible:
        raise ValueError(
            f"`communication`='reduce_scatter' needs a quantizer whose decoded sum can be "
            f"compressed again (onebit, qsgd, terngrad, signsgd, efsignsgd), got {compressor!r}")
    if communication == "low_rank" and not compressor.low_rank:
        raise ValueError(
            f"`communication`='low_rank' needs a low-rank compressor (powersgd), got "
            f"{compressor!r}")
    return communication


__all__ = ["COMMUNICATIONS", "PairExchanger", "check_communication", "choose_communication",
           "chunk_bounds", "chunk_plan", "fused_all_reduce", "gather_from_owners",
           "gather_payloads", "pair_rounds", "scatter_to_owners", "share_root_indices",
           "sparse_all_reduce"]
