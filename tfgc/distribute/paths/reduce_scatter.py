"""The quantized reduce-scatter and all-gather, with error feedback at both stages.

Each worker owns one chunk of every compressed gradient: it combines the workers'
compressed chunks, compresses the sum again and all-gathers it. The compressor is
reached through its ``chunk_recompression`` part (``chunk_layout``, ``recompress``),
``aggregate`` and, under error feedback, its ``error_feedback`` pair (``corrected``,
and the inner compressor's ``compress_with_feedback``); TernGrad through its
``shared_scale`` part (``clipped``, ``compress_scaled``, ``count_payload_words``,
``sum_codes``, ``decode_counts``; see ``tfgc.compressors.protocols``). The 16-bit casts
take it too: their owners sum in float32 and round once.

A gradient larger than the step's ``piece_bytes`` (``overlap_bytes``) is reduced in
pieces (``pieces_of``), so that its compression, its bytes and its decoding pipeline.
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
        # A gradient with fewer elements than workers is sent as it is: no owner.
        if (self._compressor.error_feedback is not None
                and shape.num_elements() >= self._num_ranks):
            layout = self._compressor.chunk_recompression.chunk_layout(shape, self._num_ranks)
            width = max(int(c.num_elements()) for _, _, c in
                        collectives.chunk_plan(layout, shape, self._num_ranks).chunks)
            template = dict(template, server_residual=tf.zeros([width], dtype))
        return template


# Pieces are no smaller than this: each costs a round of exchanges and an all-gather.
MIN_PIECE_BYTES = 1 << 20


def pieces_of(recompression, plan, nbytes_: int, piece_bytes: int):
    """How each owner's chunk of a gradient is cut into pieces: one ``ChunkPlan`` a
    chunk (cut as the compressor cuts a gradient among workers, ``chunk_layout``), or
    None when the gradient goes whole (``piece_bytes`` 0, or a gradient no larger).

    A gradient of more than ``piece_bytes`` bytes (at least ``MIN_PIECE_BYTES``) is
    cut, where the compressor views its chunks flat (QSGD, TernGrad, signSGD, the
    casts; not 1-bit SGD), into ceil(bytes / ``piece_bytes``) pieces, at most as
    many as its smallest chunk has elements. Piece k is the k-th part of every
    owner's chunk, so an owner still owns its whole chunk (its second residual
    keeps its layout) and each piece is reduced on its own (its own messages, its
    own decoding): the wire carries one piece while the CPU compresses the next
    and decodes the last.
    """
    if piece_bytes <= 0:
        return None
    piece_bytes = max(piece_bytes, MIN_PIECE_BYTES)
    if nbytes_ <= piece_bytes:
        return None
    count = min(-(-nbytes_ // piece_bytes),
                min(int(shape.num_elements()) for _, _, shape in plan.chunks))
    if count < 2:
        return None
    cuts = [collectives.chunk_plan(recompression.chunk_layout(shape, count), shape, count)
            for _, _, shape in plan.chunks]
    # Only ranges of a flat view, cut at the compressor's units: they cost no copy and
    # are coded as in the whole chunk (QSGD's buckets, signSGD's and TernGrad's
    # elements), but for a statistic of the whole chunk, which each piece then has of
    # its own (EF-signSGD's scale, as each chunk already has). Row blocks would carry
    # 1-bit SGD's column means of their own (other bits, more bytes) and column blocks
    # strided copies, which cost 1-bit SGD more than pieces save (wide MLP, 2
    # workers: 62 -> 95 ms a step at 10 Gbit/s, 119 -> 126 ms at 100 Mbit/s).
    if any(cut.view[0] != 1 for cut in cuts):
        return None
    return cuts


def _context_index(index: int, piece: int, n: int, chunk: int) -> int:
    """The context index of a piece of a chunk (``chunk`` n: the owner's sum).

    Piece 0 draws as a gradient reduced whole does; the others, apart from every
    gradient's (there are fewer than 2**20 of them in a step).
    """
    return (index + (piece << 20)) * (n + 1) + chunk


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
    A gradient larger than ``piece_bytes`` is reduced in pieces (``pieces_of``),
    each in messages of its own, so that compressing, sending and decoding
    pipeline within the gradient.
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
    for i in dense_pos:
        if mask[i]:
            wire.uncompressed_gradient(base.name_of(variables[i]), base.nbytes(tensors[i]),
                                       "fewer elements than workers (reduce-scatter)")
    if not compressed:
        reduced = base.reduce_dense(rs, dense_pos)
        return [reduced[i] for i in dense_pos], None

    # Each gradient's place among the step's compressed ones seeds its contexts.
    position = {i: rs.first_index + index for index, i in enumerate(compressed)}

    # 1. Cut into chunks, and the chunks into pieces. State is only read here.
    plans, cuts, slots, flats, velocities = {}, {}, {}, {}, {}
    for i in compressed:
        t = tensors[i]
        plans[i] = collectives.chunk_plan(recompression.chunk_layout(t.shape, n), t.shape, n)
        cuts[i] = pieces_of(recompression, plans[i], base.nbytes(t), rs.piece_bytes)
        slots[i] = state.slot(variables[i], replica_id)
        if error_feedback:
            t, velocities[i] = base.corrected(compressor, t, slots[i])
        flats[i] = inner.clipped(t) if shared_scale else tf.reshape(t, [-1])

    def count(i):
        return 1 if cuts[i] is None else len(cuts[i][0].chunks)

    def piece(i, c, x, k):
        """Piece k of ``x``, a tensor shaped as chunk c of gradient i."""
        return x if cuts[i] is None else cuts[i][c].take(x, k)

    def piece_shape(i, c, k):
        return plans[i].chunks[c][2] if cuts[i] is None else cuts[i][c].chunks[k][2]

    def whole(i, c, parts):
        """Chunk c of gradient i from its pieces."""
        return parts[0] if cuts[i] is None else cuts[i][c].join(parts, plans[i].chunks[c][2])

    scales = {}
    if shared_scale:
        # TernGrad's shared scaler: the largest of the workers' (a tiny all-gather).
        local = tf.stack([tf.reduce_max(tf.abs(flats[i])) for i in compressed])
        everyone = tf.reshape(collectives.all_gather(launcher, local, options),
                              [n, len(compressed)])
        wire.gather(base.nbytes(local))
        shared = tf.reduce_max(everyone, axis=0)
        scales = {i: shared[j] for j, i in enumerate(compressed)}
    # Units of reduction, the last layers' (the first that back-propagation
    # produces) first: a gradient, or a piece of one.
    units = [(i, k) for i in reversed(compressed) for k in range(count(i))]
    chunks = {u: [] for u in units}
    new_residuals, new_second = {}, {}
    for i in compressed:
        plan = plans[i]
        residual = slots[i]["residual"].read_value() if error_feedback else None
        parts = []
        for c in range(n):
            x = plan.take(flats[i], c)
            r_c = plan.take(residual, c) if error_feedback else None
            piece_parts = []
            for k in range(count(i)):
                cctx = CompressContext(rank=rank, num_workers=n,
                                       index=_context_index(position[i], k, n, c), step=step)
                x_k = piece(i, c, x, k)
                if error_feedback:
                    payload, _, r = inner.compress_with_feedback(x_k, piece(i, c, r_c, k), {},
                                                                cctx)
                    piece_parts.append(r)
                elif shared_scale:
                    payload = inner.compress_scaled(x_k, scales[i], cctx)
                else:
                    payload = inner.compress(x_k, {}, cctx)[0]
                chunks[(i, k)].append(tuple(payload))
            if error_feedback:
                parts.append(whole(i, c, piece_parts))
        if error_feedback:
            new_residuals[i] = plan.join(parts, tensors[i].shape)

    # 2. Messages of at most bucket_bytes, in the units' order: a unit's
    #    exchanges need only its own gradient, so they can run while earlier
    #    layers' gradients are still being computed and compressed. A piece
    #    travels alone.
    widths = {u: max(num_payload_words(p) for p in chunks[u]) for u in units}
    if shared_scale:
        # TernGrad's owners send exact sums of codes, in wider fields.
        second_like = {(i, k): [(tf.TensorSpec([1], tf.float32), tf.TensorSpec(
            [inner.count_payload_words(piece_shape(i, c, k), n) - 1], tf.int32))
            for c in range(n)]
            for i, k in units}
    else:
        second_like = chunks
    widths2 = {u: max(num_payload_words(p) for p in second_like[u]) for u in units}
    messages, current = [], []
    for u in units:
        if current and (count(u[0]) > 1 or count(current[0][0]) > 1 or
                        4 * (sum(widths[v] for v in current) + widths[u]) > rs.bucket_bytes):
            messages.append(current)
            current = []
        current.append(u)
    messages.append(current)
    control = guard.control_words(guard.local_bad([tensors[i] for i in compressed]), step,
                                  tf.int32)
    gathered, gathered_control = {}, None
    second_parts = {i: [None] * count(i) for i in compressed}
    exchanger = rs.exchanger()
    for b, message in enumerate(messages):
        last = b == len(messages) - 1
        # Stage 1: each chunk to its owner, the message's chunks in one exchange.
        outgoing = {p: tf.concat([padded_payload_words(chunks[u][p], widths[u])
                                  for u in message], 0)
                    for p in range(n) if p != rank}
        received = collectives.scatter_to_owners(exchanger, n, outgoing)
        length = sum(widths[u] for u in message)
        for i, k in message:
            sent = sum(num_payload_words(chunks[(i, k)][p]) for p in range(n) if p != rank)
            wire.pairwise(4 * sent, base.nbytes(tensors[i]) if k == 0 else 0, 0)
        # A rank tag per exchange; padding to the longest chunk counts as sent.
        wire.pairwise(0, 0, (n - 1) * 4 * (length + 1))

        # The owner combines its chunk and compresses the result again.
        second = {}
        offset = 0
        for u in message:
            i, k = u
            shape = piece_shape(i, rank, k)
            mine = chunks[u][rank]
            payloads = [mine if w == rank else
                        unpack_payload_words(received[w][offset:offset + widths[u]], mine)
                        for w in range(n)]
            offset += widths[u]
            cctx = CompressContext(rank=rank, num_workers=n,
                                   index=_context_index(position[i], k, n, n), step=step)
            dtype = tensors[i].dtype
            if shared_scale:
                second[u] = tuple(inner.sum_codes(payloads, shape))
                continue
            total = inner.aggregate(payloads, shape, dtype, cctx)
            if error_feedback:
                server = slots[i]["server_residual"].read_value()
                chunk_shape = plans[i].chunks[rank][2]
                server = tf.reshape(server[:chunk_shape.num_elements()], chunk_shape)
                payload, _, r = inner.compress_with_feedback(
                    total, piece(i, rank, server, k), {}, cctx)
                second_parts[i][k] = r
            else:
                payload = inner.recompress(total, cctx)
            second[u] = tuple(payload)

        # Stage 2: every owner's result to everyone; the control words ride on
        # the last message.
        words = tf.concat([padded_payload_words(second[u], widths2[u]) for u in message], 0)
        rows, rows_control = collectives.gather_from_owners(
            launcher, words, n, options, control if last else None)
        offset = 0
        for u in message:
            gathered[u] = rows[:, offset:offset + widths2[u]]
            offset += widths2[u]
            wire.gather(4 * num_payload_words(second[u]))
        padding = sum(widths2[u] - num_payload_words(second[u]) for u in message)
        extra = base.nbytes(control) if last else 0
        wire.pairwise(extra, 0, (n - 1) * (4 * padding + extra))
        if last:
            gathered_control = rows_control
    if error_feedback:
        for i in compressed:
            width = int(slots[i]["server_residual"].shape[0])
            flat = tf.reshape(whole(i, rank, second_parts[i]), [-1])
            new_second[i] = tf.pad(flat, [[0, width - int(flat.shape[0])]])

    reduced = base.reduce_dense(rs, dense_pos)

    ok = guard.ok(gathered_control, n, step)

    # 3. Decode every owner's chunk, piece by piece as each arrives; commit both
    #    residuals, or keep them.
    def decode_one(i):
        t = tensors[i]
        parts = []
        for w in range(n):
            piece_parts = []
            for k in range(count(i)):
                payload = unpack_payload_words(gathered[(i, k)][w], second_like[(i, k)][w])
                shape = piece_shape(i, w, k)
                if shared_scale:
                    part = inner.decode_counts(payload, shape, t.dtype, n)
                else:
                    cctx = CompressContext(rank=w, num_workers=n,
                                           index=_context_index(position[i], k, n, n),
                                           step=step)
                    part = inner.decompress(payload, shape, t.dtype, cctx)
                piece_parts.append(part)
            parts.append(whole(i, w, piece_parts))
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
                "be compressed again (onebit, qsgd, terngrad, signsgd, efsignsgd, fp16, "
                "bf16), got "
                "{compressor!r}")
