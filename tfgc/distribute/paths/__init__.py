"""The paths a compressed gradient can take across the cluster, and their names.

``communication=`` names one of them; ``"auto"`` picks, per compressor and cluster
size, the one that sends the fewest bytes (``auto.choose_communication``). The wire
primitives a path uses are in ``tfgc.collectives``; the reductions themselves are
methods of ``tfgc.distribute.cross_device_ops.CompressedAllReduce`` for now.
"""

from tfgc.distribute.paths.auto import choose_communication

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


__all__ = ["COMMUNICATIONS", "check_communication", "choose_communication"]
