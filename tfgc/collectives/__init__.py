"""How payloads cross the wire, over TensorFlow's collective runtime.

Each function takes a ``CollectiveReplicaLauncher`` (one per local device, owned by
the cross-device ops), so every collective tfgc issues shares TensorFlow's instance
keys and ordering token: workers launch them in one order and cannot deadlock.

Wire only: nothing here knows a compressor. Payloads arrive as tensors (or int32
words), and a chunk plan from a layout; which path a compressor takes, and the byte
model behind ``communication="auto"``, live in ``tfgc.distribute.paths``.
"""

from tfgc.collectives.allgather import all_gather, gather_payloads
from tfgc.collectives.dense import fused_all_reduce
from tfgc.collectives.pairwise import PairExchanger
from tfgc.collectives.reduce_scatter import (chunk_bounds, chunk_plan, gather_from_owners,
                                             pair_rounds, scatter_to_owners)
from tfgc.collectives.shared_index import share_root_indices
from tfgc.collectives.sparse_allreduce import sparse_all_reduce

__all__ = ["PairExchanger", "all_gather", "chunk_bounds", "chunk_plan", "fused_all_reduce", "gather_from_owners",
           "gather_payloads", "pair_rounds", "scatter_to_owners", "share_root_indices",
           "sparse_all_reduce"]
