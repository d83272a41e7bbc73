"""The sparse all-reduce: every worker's (values, indices) merged by recursive doubling."""

import tensorflow as tf

from tfgc import collectives
from tfgc.distribute.paths import base, guard


def reduce(rs: base.ReductionStep):
    """Top-k payloads summed by the sparse all-reduce with a dense switch.

    Every compressed gradient's (values, indices) go into one index space (each
    tensor at its own offset), merged stage by stage over pairwise exchanges
    (``collectives.sparse_all_reduce``); the control words take one small int32
    all-reduce of the whole group.
    """
    tensors, mask, step_var, launcher = rs.tensors, rs.mask, rs.step_var, rs.launcher
    options, wire = rs.options, rs.wire
    n = rs.num_workers
    step = step_var.read_value()
    compressed = [i for i, m in enumerate(mask) if m]
    payloads, _, slots, new_states = base.compress_each(rs, compressed, step)
    all_idx, all_val, offsets, length = [], [], {}, 0
    for i in compressed:
        values, indices = rs.compressor.sparse_entries.entries(payloads[i])
        offsets[i] = length
        all_idx.append(indices + length)
        all_val.append(tf.cast(values, tf.float32))
        wire.exchanged(base.payload_bytes(payloads[i], False), base.nbytes(tensors[i]), 0)
        length += tensors[i].shape.num_elements()
    control = guard.control_words(guard.local_bad([tensors[i] for i in compressed]), step,
                                  tf.int32)
    control_sum = launcher.all_reduce(control, options=options)
    wire.allreduce(base.nbytes(control))
    total, sent = collectives.sparse_all_reduce(
        rs.exchanger(), n, tf.concat(all_idx, 0), tf.concat(all_val, 0),
        length)
    wire.dynamic_sent.append(sent)
    ok = guard.ok(control_sum, n, step)

    reduced = base.reduce_dense(rs, [i for i in range(len(tensors)) if i not in slots])

    def decode_one(i):
        t = tensors[i]
        part = total[offsets[i]:offsets[i] + t.shape.num_elements()]
        return (tf.reshape(tf.cast(part, t.dtype), t.shape),
                base.writes(slots[i], new_states[i]))

    outputs = guard.commit_or_skip(rs, ok, compressed, reduced, decode_one)
    return outputs, ok


PATH = base.Path(
    name="sparse_allreduce", describe="the sparse all-reduce",
    accepts=lambda c: c.sparse_entries is not None, reduce=reduce,
    requirement="`communication`='sparse_allreduce' needs a sparsifier whose payload is "
                "(values, indices) (topk, ef+topk), got {compressor!r}")
