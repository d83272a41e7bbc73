"""The paths a compressed gradient can take across the cluster: one module each.

``PATHS`` maps each name that ``communication=`` accepts to its ``base.Path``: what it
accepts, how the logs describe it, its state layout and its ``reduce(step)``.
``"auto"`` picks, per compressor and cluster size, the path that sends the fewest bytes
(``auto.choose_communication``). The wire primitives the paths use are in
``tfgc.collectives``; the guard they share (control words, agreement, commit or skip)
is ``guard``. Adding a path is one module and its line here.
"""

from tfgc.distribute.paths import allgather, low_rank, reduce_scatter, shared_index
from tfgc.distribute.paths import sparse_allreduce
from tfgc.distribute.paths.auto import choose_communication
from tfgc.distribute.paths.base import Path, ReductionStep

PATHS = {path.name: path for path in (
    allgather.ALLREDUCE,        # summable payloads: one fused all-reduce
    allgather.ALLGATHER,        # any payload
    reduce_scatter.PATH,        # quantizers whose decoded sum can be compressed again
    shared_index.PATH,          # sparsifiers that select indices: one worker's set for all
    sparse_allreduce.PATH,      # (values, indices) payloads, merged stage by stage
    low_rank.PATH,              # PowerSGD: two all-reduces of a shared power iteration
)}
COMMUNICATIONS = ("auto",) + tuple(PATHS)


def check_communication(communication, compressor):
    """Refuses a communication scheme that cannot carry ``compressor``'s payloads."""
    if communication not in COMMUNICATIONS:
        raise ValueError(f"`communication` must be one of {COMMUNICATIONS}, got {communication!r}")
    if communication != "auto" and compressor.plans_per_tensor:
        raise ValueError(f"compressor {compressor.name!r} chooses every gradient's path itself; "
                         f"leave `communication`='auto', got {communication!r}")
    if communication != "auto" and not PATHS[communication].accepts(compressor):
        raise ValueError(PATHS[communication].requirement.format(compressor=compressor))
    return communication


__all__ = ["COMMUNICATIONS", "PATHS", "Path", "ReductionStep", "check_communication",
           "choose_communication"]
