"""The index exchange of the shared-index all-reduce (Cheng & Xu 2019).

Importance-weighted pruning on a ring all-reduce: each step one worker, the root,
chooses the index set, every worker takes its own values at those indices, and the
values are summed by the plain dense all-reduce; what is not sent stays in each
worker's residual. The index set is shared, so the values add up position by
position and nothing fills in.

The root's indices reach every worker through an int32 all-reduce to which only
the root contributes (the others send zeros): TensorFlow's CPU collectives have no
broadcast that shares the strategy's instance keys, and the sum of integers is
exact. Per worker that costs 2(N-1)/N x 4k bytes, the same as the values' own
all-reduce, so the whole exchange sends 2(N-1)/N x 8k bytes against (N-1) x 8k for
an all-gather of every worker's (value, index) pairs.
"""

from typing import List, Optional, Tuple

import tensorflow as tf


def share_root_indices(launcher, index_sets: List[tf.Tensor], is_root, options,
                       control: Optional[tf.Tensor] = None
                       ) -> Tuple[List[tf.Tensor], Optional[tf.Tensor]]:
    """Gives every worker the root's index sets.

    Args:
      launcher: the replica's ``CollectiveReplicaLauncher``.
      index_sets: this worker's int32 index vectors (static shapes, the same on
        every worker); only the root's are used.
      is_root: scalar bool tensor, True on exactly one worker.
      options: ``tf.distribute.experimental.CommunicationOptions``.
      control: an optional int32 vector every worker contributes to (flags,
        counters); its sum over workers comes back.

    Returns:
      ``(root_index_sets, control_sum)``.
    """
    sizes = [int(i.shape[0]) for i in index_sets]
    mine = tf.concat([tf.reshape(i, [-1]) for i in index_sets], axis=0)
    parts = [tf.where(is_root, mine, tf.zeros_like(mine))]
    if control is not None:
        parts.append(tf.reshape(control, [-1]))
    summed = launcher.all_reduce(tf.concat(parts, axis=0), options=options)
    shared = tf.split(summed[:sum(sizes)], sizes) if len(sizes) > 1 else [summed[:sizes[0]]]
    return shared, (summed[sum(sizes):] if control is not None else None)
