"""The quantized reduce-scatter and all-gather, with error feedback at both stages.

Each worker owns one chunk of every compressed gradient: it combines the workers'
compressed chunks, compresses the sum again and all-gathers it. The compressor is
reached through its ``chunk_recompression`` part (``chunk_layout``, ``recompress``),
``aggregate`` and, under error feedback, its ``error_feedback`` pair (``corrected``,
and the inner compressor's ``compress_with_feedback``); TernGrad through its ``shared_scale`` part (``clipped``,
``compress_scaled``, ``count_payload_words``, ``sum_codes``, ``decode_counts``; see
``tfgc.compressors.protocols``).
"""

import tensorflow as tf

from tfgc import collectives
from tfgc.collectives.allgather import (num_payload_words, padded_payload_words,
                                        unpack_payload_words)
from tfgc.compressors import CompressContext
from tfgc.distribute.paths import base, guard


class TwoStageState:
    """The state template of the reduce-scatter: error feedback adds the owner's residual.

    ``server_residual`` holds this worker's chunk, flat, padded to the longest
    chunk (the same length on every worker, so the checkpoint rows line up).
    """

    def __init__(self, compressor, num_ranks: int):
        self._compressor = compressor
        self._num_ranks = num_ranks

    def init_state(self, shape, dtype):
        template = self._compressor.init_state(shape, dtype)
        if self._compressor.error_feedback is not None:
            layout = self._compressor.chunk_recompression.chunk_layout(shape, self._num_ranks)
            width = max(int(c.num_elements()) for _, _, c in
                        collectives.chunk_plan(layout, shape, self._num_ranks).chunks)
            template = dict(template, server_residual=tf.zeros([width], dtype))
        return template


def reduce(rs: base.ReductionStep):
    """Quantized reduce-scatter then all-gather, error feedback at both stages.

    Each compressed gradient is cut into one chunk per worker
    (``collectives.chunk_plan``). Stage 1 compresses every chunk (under error
    feedback, of v = g + residual, keeping v - decode as the new residual) and
    sends it to the chunk's owner; the owner combines the N payloads of its
    chunk with the compressor's ``aggregate`` (signSGD: the majority vote),
    adds its second residual and compresses the sum again (``recompress``).
    TernGrad first agrees on a shared scaler, and its owners send the exact
    sums of the ternary codes (``sum_codes``).
    Stage 2 all-gathers the owners' payloads, the control words riding along;
    every worker decodes the same payloads, so all end with the same bits.
    Messages hold up to ``bucket_bytes`` of chunks, last layers first.
    Gradients too small to cut into N chunks, and uncompressed ones, go
    through the fused dense all-reduce.
    """
    compressor, tensors, variables, mask = rs.compressor, rs.tensors, rs.variables, rs.mask
    state, step_var, launcher, rank = rs.state, rs.step_var, rs.launcher, rs.rank
    replica_id, options, wire = rs.replica_id, rs.options, rs.wire
    recompression = compressor.chunk_recompression
    error_feedback = compressor.error_feedback is not None
    inner = compressor.error_feedback.inner if error_feedback else compressor
    shared_scale = inner.shared_scale is not None and not error_feedback
    if shared_scale:
        inner = inner.shared_scale
    n = rs.num_workers
    step = step_var.read_value()
    dense_pos = [i for i, t in enumerate(tensors)
                 if not mask[i] or t.shape.num_elements() < n]
    compressed = [i for i in range(len(tensors)) if i not in dense_pos]
    if not compressed:
        reduced = base.reduce_dense(rs, dense_pos)
        return [reduced[i] for i in dense_pos], None

    # Each gradient's place among the step's compressed ones seeds its contexts.
    position = {i: rs.first_index + index for index, i in enumerate(compressed)}

    # 1. Cut, and compress every chunk for its owner. State is only read here.
    plans, chunks, slots, new_residuals, new_second = {}, {}, {}, {}, {}
    flats, velocities = {}, {}
    for i in compressed:
        t = tensors[i]
        plans[i] = collectives.chunk_plan(recompression.chunk_layout(t.shape, n), t.shape, n)
        slots[i] = state.slot(variables[i], replica_id)
        if error_feedback:
            t, velocities[i] = base.corrected(compressor, t, slots[i])
        flats[i] = inner.clipped(t) if shared_scale else tf.reshape(t, [-1])
    scales = {}
    if shared_scale:
        # TernGrad's shared scaler: the largest of the workers' (a tiny all-gather).
        local = tf.stack([tf.reduce_max(tf.abs(flats[i])) for i in compressed])
        everyone = tf.reshape(collectives.all_gather(launcher, local, options),
                              [n, len(compressed)])
        wire.gather(base.nbytes(local))
        shared = tf.reduce_max(everyone, axis=0)
        scales = {i: shared[j] for j, i in enumerate(compressed)}
    for i in compressed:
        index = position[i]
        chunks[i], parts = [], []
        plan = plans[i]
        residual = slots[i]["residual"].read_value() if error_feedback else None
        for c in range(n):
            cctx = CompressContext(rank=rank, num_workers=n, index=index * (n + 1) + c,
                                   step=step)
            x = plan.take(flats[i], c)
            if error_feedback:
                payload, _, r = inner.compress_with_feedback(x, plan.take(residual, c), {},
                                                            cctx)
                parts.append(r)
            elif shared_scale:
                payload = inner.compress_scaled(x, scales[i], cctx)
            else:
                payload = inner.compress(x, {}, cctx)[0]
            chunks[i].append(tuple(payload))
        if error_feedback:
            new_residuals[i] = plan.join(parts, tensors[i].shape)

    # 2. Buckets of at most bucket_bytes per message, the last layers' gradients
    #    (the first that back-propagation produces) first: a bucket's exchanges
    #    need only its own gradients, so they can run while earlier layers'
    #    gradients are still being computed and compressed.
    widths = {i: max(num_payload_words(p) for p in chunks[i]) for i in compressed}
    if shared_scale:
        # TernGrad's owners send exact sums of codes, in wider fields.
        second_like = {i: [(tf.TensorSpec([1], tf.float32), tf.TensorSpec(
            [inner.count_payload_words(shape, n) - 1], tf.int32))
            for _, _, shape in plans[i].chunks]
            for i in compressed}
    else:
        second_like = chunks
    widths2 = {i: max(num_payload_words(p) for p in second_like[i]) for i in compressed}
    buckets, current = [], []
    for i in reversed(compressed):
        if current and 4 * (sum(widths[j] for j in current) + widths[i]) > rs.bucket_bytes:
            buckets.append(current)
            current = []
        current.append(i)
    buckets.append(current)
    control = guard.control_words(guard.local_bad([tensors[i] for i in compressed]), step,
                                  tf.int32)
    gathered, gathered_control = {}, None
    exchanger = rs.exchanger()
    for b, bucket in enumerate(buckets):
        last = b == len(buckets) - 1
        # Stage 1: each chunk to its owner, the bucket's chunks in one message.
        outgoing = {p: tf.concat([padded_payload_words(chunks[i][p], widths[i])
                                  for i in bucket], 0)
                    for p in range(n) if p != rank}
        received = collectives.scatter_to_owners(exchanger, n, outgoing)
        message = sum(widths[i] for i in bucket)
        for i in bucket:
            sent = sum(num_payload_words(chunks[i][p]) for p in range(n) if p != rank)
            wire.pairwise(4 * sent, base.nbytes(tensors[i]), 0)
        # A rank tag per exchange; padding to the longest chunk counts as sent.
        wire.pairwise(0, 0, (n - 1) * 4 * (message + 1))

        # The owner combines its chunk and compresses the result again.
        second = {}
        offset = 0
        for i in bucket:
            index = position[i]
            shape = plans[i].chunks[rank][2]
            mine = chunks[i][rank]
            payloads = [mine if w == rank else
                        unpack_payload_words(received[w][offset:offset + widths[i]], mine)
                        for w in range(n)]
            offset += widths[i]
            cctx = CompressContext(rank=rank, num_workers=n, index=index * (n + 1) + n,
                                   step=step)
            dtype = tensors[i].dtype
            if shared_scale:
                second[i] = tuple(inner.sum_codes(payloads, shape))
                continue
            total = inner.aggregate(payloads, shape, dtype, cctx)
            if error_feedback:
                server = slots[i]["server_residual"].read_value()
                size = shape.num_elements()
                payload, _, r = inner.compress_with_feedback(
                    total, tf.reshape(server[:size], shape), {}, cctx)
                new_second[i] = tf.pad(tf.reshape(r, [-1]),
                                       [[0, int(server.shape[0]) - size]])
            else:
                payload = inner.recompress(total, cctx)
            second[i] = tuple(payload)

        # Stage 2: every owner's result to everyone; the control words ride on
        # the last bucket.
        words = tf.concat([padded_payload_words(second[i], widths2[i]) for i in bucket], 0)
        rows, rows_control = collectives.gather_from_owners(
            launcher, words, n, options, control if last else None)
        offset = 0
        for i in bucket:
            gathered[i] = rows[:, offset:offset + widths2[i]]
            offset += widths2[i]
            wire.gather(4 * num_payload_words(second[i]))
        padding = sum(widths2[i] - num_payload_words(second[i]) for i in bucket)
        extra = base.nbytes(control) if last else 0
        wire.pairwise(extra, 0, (n - 1) * (4 * padding + extra))
        if last:
            gathered_control = rows_control

    reduced = base.reduce_dense(rs, dense_pos)

    ok = guard.ok(gathered_control, n, step)

    # 3. Decode every owner's chunk; commit both residuals, or keep them.
    def decode_one(i):
        t = tensors[i]
        parts = []
        index = position[i]
        for w, (_, _, shape) in enumerate(plans[i].chunks):
            payload = unpack_payload_words(gathered[i][w], second_like[i][w])
            if shared_scale:
                part = inner.decode_counts(payload, shape, t.dtype, n)
            else:
                cctx = CompressContext(rank=w, num_workers=n, index=index * (n + 1) + n,
                                       step=step)
                part = inner.decompress(payload, shape, t.dtype, cctx)
            parts.append(part)
        new_state = []
        if error_feedback:
            new_state = [(slots[i]["residual"], new_residuals[i]),
                         (slots[i]["server_residual"], new_second[i])]
            new_state += base.writes(slots[i], velocities[i])
        return plans[i].join(parts, t.shape), new_state

    outputs = guard.commit_or_skip(rs, ok, compressed, reduced, decode_one)
    return outputs, ok


PATH = base.Path(
    name="reduce_scatter", describe="the reduce-scatter / all-gather",
    accepts=lambda c: c.chunk_recompression is not None, reduce=reduce, state_layout=TwoStageState,
    requirement="`communication`='reduce_scatter' needs a quantizer whose decoded sum can "
                "be compressed again (onebit, qsgd, terngrad, signsgd, efsignsgd), got "
                "{compressor!r}")
