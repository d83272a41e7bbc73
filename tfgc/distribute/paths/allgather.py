"""The all-gather path, and the plain all-reduce for summable payloads.

Dense tensors and summable payloads (``compressor.summable``: casts, random-k with a
shared seed) go through one fused all-reduce per dtype; every other payload is packed
into int32 words and all-gathered, a few tensors per collective, then combined in rank
order with the compressor's ``aggregate`` (bit-identical on every worker). The control
words ride on the all-reduce (summed) or on the first gather (gathered). The fused
all-reduce packs in the stock implementation's order, so the dense tensors add as the
stock strategy adds them. (Identity itself never comes here: it takes the stock
all-reduce, ``Compressor.reduces_as_stock``.)
"""

import tensorflow as tf

from tfgc import collectives
from tfgc.distribute.paths import base, guard


def reduce(rs: base.ReductionStep):
    """Compress, all-reduce or all-gather, check, then decode and commit (or skip)."""
    compressor, tensors, step_var = rs.compressor, rs.tensors, rs.step_var
    launcher, options, wire = rs.launcher, rs.options, rs.wire
    n = rs.num_workers
    use_allreduce = rs.path == "allreduce"
    step = step_var.read_value()

    # 1. Compress. State is read now and written only once every worker's
    #    gradients are known to be finite.
    payloads, contexts, slots, new_states = base.compress_each(rs, rs.compressed, step)
    has_state = any(tf.nest.flatten(s) for s in slots.values())
    # Stateless compressors that carry every inf/NaN through need no check.
    checked = has_state or not compressor.passes_non_finite
    local_bad = guard.local_bad([tensors[i] for i in payloads]) if checked else None

    # 2. Communicate: one fused all-reduce (per dtype) for dense tensors and
    #    summable payloads, fused all-gathers for the other payloads; the
    #    control words ride along.
    to_reduce = []
    for i, t in enumerate(tensors):
        if i not in payloads:
            to_reduce.append((i, t))
            wire.allreduce(base.nbytes(t), dense=base.nbytes(t))
        elif use_allreduce:
            if len(payloads[i]) != 1:
                raise ValueError(f"{compressor!r} is summable, so its payload must be "
                                 f"one tensor, got {len(payloads[i])}")
            to_reduce.append((i, payloads[i][0]))
            wire.allreduce(base.payload_bytes(payloads[i], False), dense=base.nbytes(t))
    control = None
    if checked and use_allreduce:
        control = guard.control_words(local_bad, step, tf.float32)
        to_reduce.append((-1, control))
        wire.allreduce(base.nbytes(control))
    # Reversed, as the stock implementation packs: dense tensors add as stock adds them.
    reduced = collectives.fused_all_reduce(launcher, [t for _, t in to_reduce][::-1],
                                           options)[::-1]
    reduced = {i: r for (i, _), r in zip(to_reduce, reduced)}
    gathered, gathered_control = {}, None
    if not use_allreduce:
        order = sorted(payloads)
        extra = guard.control_words(local_bad, step, tf.int32) if checked else None
        exchanged, gathered_control = collectives.gather_payloads(
            launcher, [payloads[i] for i in order], n, options, rs.bucket_bytes,
            control=extra)
        gathered = dict(zip(order, exchanged))
        for i in order:
            wire.gather(base.payload_bytes(payloads[i], True), dense=base.nbytes(tensors[i]))
        if checked:
            wire.gather(base.nbytes(extra))

    # 3. Did every worker have finite gradients and the same step?
    ok = None
    if checked:
        ok = guard.ok(reduced[-1] if use_allreduce else gathered_control, n, step)

    # 4. Decode and combine; commit the new state, or keep the old one.
    def decode_one(i):
        t = tensors[i]
        new_state = new_states[i]
        if use_allreduce:
            out, new_state = compressor.finish((reduced[i],), t.shape, t.dtype, contexts[i],
                                               new_state)
        else:
            out = compressor.aggregate(gathered[i], t.shape, t.dtype, contexts[i])
        return out, base.writes(slots[i], new_state)

    outputs = guard.commit_or_skip(rs, ok, sorted(payloads), reduced, decode_one)
    return outputs, ok


ALLREDUCE = base.Path(
    name="allreduce", describe="all-reduce", accepts=lambda c: c.summable, reduce=reduce,
    requirement="`communication`='allreduce' needs a summable compressor, but {compressor!r} "
                "payloads do not add element-wise (they carry per-worker indices or scales); "
                "use 'allgather' or 'auto'")
ALLGATHER = base.Path(
    name="allgather", describe="all-gather", accepts=lambda c: True, reduce=reduce,
    requirement="")
