"""Dense all-reduce of many tensors, fused into one collective per dtype."""

from typing import List

import tensorflow as tf
from tensorflow.python.distribute import cross_device_utils


def fused_all_reduce(launcher, tensors: List[tf.Tensor], options) -> List[tf.Tensor]:
    """Sums ``tensors`` over all workers with as few collectives as possible.

    Tensors are grouped by dtype (a collective carries one dtype) and, within a
    dtype, packed exactly as TensorFlow's ``CollectiveAllReduce`` packs them
    (``options.bytes_per_pack``; 0 means a single pack). The same tensors in the
    same order therefore reduce bit-identically to the stock strategy.
    """
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    results = [None] * len(tensors)
    for positions in by_dtype.values():
        group = [tensors[i] for i in positions]
        packs = cross_device_utils.group_by_size(group, options.bytes_per_pack)
        reduced = launcher.batch_all_reduce(packs, options)
        for i, r in zip(positions, reduced):
            results[i] = r
    return results
