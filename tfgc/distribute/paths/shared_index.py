"""The shared-index all-reduce: one worker's index set, in rotation, serves every worker.

Importance-weighted pruning's aggregation (Cheng & Xu 2019), offered for top-k too. The
compressor is reached through its ``index_selection`` part (``select_indices`` and
``num_selected``, its selection rule) and, under error feedback, through its
``error_feedback`` pair (``tfgc.compressors.protocols``): ``corrected`` and the
``residual`` state entry, which this path updates itself: the new residual is v with
the sent entries zeroed.
"""

import tensorflow as tf

from tfgc import collectives
from tfgc.distribute.paths import base, guard


def reduce(rs: base.ReductionStep):
    """Importance-weighted pruning's shared index set (Cheng & Xu 2019), with top-k.

    Each step a root, chosen in rotation (step mod N, the same on every worker),
    selects the index set of every compressed gradient from its own
    v = g + residual; the sets reach every worker through an int32 all-reduce
    (``collectives.share_root_indices``), the control words riding along.
    Every worker then gathers its own v at those indices and the values go
    through the plain fused all-reduce with the dense tensors. Under error
    feedback the new residual is v with the sent entries zeroed.
    """
    compressor, tensors, variables, mask = rs.compressor, rs.tensors, rs.variables, rs.mask
    state, step_var, launcher, rank = rs.state, rs.step_var, rs.launcher, rs.rank
    replica_id, options, wire = rs.replica_id, rs.options, rs.wire
    error_feedback = compressor.error_feedback is not None
    selection = compressor.index_selection
    n = rs.num_workers
    step = step_var.read_value()
    is_root = tf.equal(tf.math.floormod(step, n), rank)
    compressed = [i for i, m in enumerate(mask) if m]

    # 1. The root selects; everyone learns its index sets.
    flat_v, slots, selections, velocities = {}, {}, [], {}
    for index, i in enumerate(compressed):
        t = tensors[i]
        slot = state.slot(variables[i], replica_id)
        v = tf.reshape(t, [-1])
        if error_feedback:
            corrected, velocities[i] = base.corrected(compressor, t, slot)
            v = tf.reshape(corrected + slot["residual"].read_value(), [-1])
        cctx = rs.context(index, step, variables[i])
        k = selection.num_selected(t.shape)
        # Only the root pays for the selection.
        chosen = tf.cond(is_root,
                         lambda v=v, t=t, c=cctx: selection.select_indices(
                             tf.reshape(v, t.shape), c),
                         lambda k=k: tf.zeros([k], tf.int32))
        flat_v[i], slots[i] = v, slot
        selections.append(chosen)
    control = guard.control_words(guard.local_bad([tensors[i] for i in compressed]), step,
                                  tf.int32)
    shared, control_sum = collectives.share_root_indices(launcher, selections, is_root,
                                                         options, control)
    shared = dict(zip(compressed, shared))
    for i in compressed:
        wire.allreduce(4 * int(shared[i].shape[0]), dense=base.nbytes(tensors[i]))
    wire.allreduce(base.nbytes(control))
    ok = guard.ok(control_sum, n, step)

    # 2. Values at the shared indices, summed with the dense tensors.
    to_reduce = []
    for i, t in enumerate(tensors):
        if i in shared:
            # tf.gather checks every index: a corrupt set fails, never reads out of bounds.
            values = tf.gather(flat_v[i], shared[i])
            wire.allreduce(base.nbytes(values))
        else:
            values = t
            wire.allreduce(base.nbytes(t), dense=base.nbytes(t))
        to_reduce.append(values)
    reduced = collectives.fused_all_reduce(launcher, to_reduce[::-1], options)[::-1]

    # 3. Scatter the sums back; commit the residuals, or keep them.
    def decode_one(i):
        t = tensors[i]
        idx = shared[i][:, None]
        new_state = []
        if error_feedback:
            kept = tf.tensor_scatter_nd_update(flat_v[i], idx, tf.zeros_like(reduced[i]))
            new_state = [(slots[i]["residual"], tf.reshape(kept, t.shape))]
            new_state += base.writes(slots[i], velocities[i])
        return (tf.reshape(tf.scatter_nd(idx, reduced[i], [t.shape.num_elements()]), t.shape),
                new_state)

    outputs = guard.commit_or_skip(rs, ok, compressed, reduced, decode_one)
    return outputs, ok


PATH = base.Path(
    name="shared_index", describe="the shared-index all-reduce",
    accepts=lambda c: c.index_selection is not None, reduce=reduce,
    requirement="`communication`='shared_index' needs a sparsifier that selects indices "
                "(topk, ef+topk), got {compressor!r}")
