"""PowerSGD's path: two fused all-reduces of low-rank factors per step.

The algorithm is split between two files that name each other: the compressor
(``tfgc/compressors/powersgd.py``) holds the matrix view ``matrix``, the query ``query``
and ``orthogonalize``; this path runs the power iteration's two rounds across the
workers, and writes the residual and the next query.
"""

import tensorflow as tf

from tfgc import collectives
from tfgc.compressors.powersgd import orthogonalize
from tfgc.distribute.paths import base, guard


def reduce(rs: base.ReductionStep):
    """PowerSGD's shared power iteration: two fused all-reduces per step.

    Round 1 sums P_i = M_i Q (M_i = g_i + e_i, Q the shared query) with the
    dense gradients and the control words; every worker orthogonalizes the same
    sum into P^. Round 2 sums Q_i = M_i^T P^. The output is P^ Q^T, the residual
    M_i - P^ Q^T / N and the next query Q / N, committed only when every worker's
    gradients were finite (see ``tfgc.compressors.powersgd``).
    """
    compressor, tensors, variables, mask = rs.compressor, rs.tensors, rs.variables, rs.mask
    state, step_var, launcher = rs.state, rs.step_var, rs.launcher
    replica_id, options, wire = rs.replica_id, rs.options, rs.wire
    n = rs.num_workers
    step = step_var.read_value()
    compressed = [i for i, m in enumerate(mask) if m]
    low_rank = compressor.low_rank
    slots, matrices, factors = {}, {}, {}
    for index, i in enumerate(compressed):
        t = tensors[i]
        slots[i] = state.slot(variables[i], replica_id)
        cctx = rs.context(index, step)
        matrices[i] = low_rank.matrix(t, slots[i]["residual"].read_value())
        query = low_rank.query(slots[i]["query"].read_value(), cctx)
        factors[i] = tf.matmul(matrices[i], query)
        wire.allreduce(base.nbytes(factors[i]), dense=base.nbytes(t))
    control = guard.control_words(guard.local_bad([tensors[i] for i in compressed]), step,
                                  tf.float32)
    wire.allreduce(base.nbytes(control))

    # Round 1: the P_i, the dense gradients and the control words.
    first = [factors[i] for i in compressed] + [control]
    dense_pos = [i for i in range(len(tensors)) if i not in slots]
    for i in dense_pos:
        first.append(tensors[i])
        wire.allreduce(base.nbytes(tensors[i]), dense=base.nbytes(tensors[i]))
    summed = collectives.fused_all_reduce(launcher, first[::-1], options)[::-1]
    reduced = dict(zip(dense_pos, summed[len(compressed) + 1:]))
    ok = guard.ok(summed[len(compressed)], n, step)

    # Round 2: Q_i = M_i^T P^ for the same P^ everywhere.
    bases = {i: orthogonalize(p) for i, p in zip(compressed, summed)}
    second = []
    for i in compressed:
        second.append(tf.matmul(matrices[i], bases[i], transpose_a=True))
        wire.allreduce(base.nbytes(second[-1]))
    queries = dict(zip(compressed, collectives.fused_all_reduce(
        launcher, second[::-1], options)[::-1]))

    def decode_one(i):
        t = tensors[i]
        out = compressor.decompress((bases[i], queries[i]), t.shape, t.dtype, None)
        size = tf.cast(n, out.dtype)
        return out, [(slots[i]["residual"], tf.reshape(matrices[i], t.shape) - out / size),
                     (slots[i]["query"], queries[i] / size)]

    outputs = guard.commit_or_skip(rs, ok, compressed, reduced, decode_one)
    return outputs, ok


PATH = base.Path(
    name="low_rank", describe="two all-reduces of low-rank factors",
    accepts=lambda c: c.low_rank is not None, reduce=reduce,
    requirement="`communication`='low_rank' needs a low-rank compressor (powersgd), got "
                "{compressor!r}")
