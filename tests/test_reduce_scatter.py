"""The quantized reduce-scatter / all-gather on real 2-, 3- and 4-worker clusters.

Each worker owns one chunk of every compressed gradient; chunks travel compressed to
their owner over pairwise exchanges, the owner combines them and compresses the sum
again, and the owners' sums are all-gathered, with error feedback at both stages.
One launch per cluster size runs ``tests/cluster/reduce_scatter.py`` (and then, in the
same processes, tests/test_sparse_paths.py's worker: ``tests/cluster/paths.py``). Its
results are checked against a replay of the algorithm (the compressors run eagerly
here, the chunking, owners and residuals are the replay's own), against NumPy models
of 1-bit SGD and signSGD's majority vote, and against the byte model of the two stages.
"""

import json
import math

import numpy as np
import pytest

from cluster_scripts import assert_fit_identical_and_learning, cluster_script, paths_cluster

_, worker = cluster_script("reduce_scatter")

COMPRESSED = worker.SHAPES[:2]
EF_SPECS = ("onebit", "efsignsgd", "onebit:momentum=0.9")
MOMENTUM = {"onebit:momentum=0.9": 0.9}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}workers")
def cluster(request, tmp_path_factory):
    n = request.param
    # The cluster of this size also runs tests/test_sparse_paths.py's paths.
    out = paths_cluster(tmp_path_factory, n) / "reduce_scatter"
    runs = [dict(np.load(out / f"reduce.w{r}.npz")) for r in range(n)]
    return n, out, runs


def plan_of(compressor, shape, n):
    """The chunk plan the reduce-scatter uses for ``compressor`` on a gradient of ``shape``."""
    import tensorflow as tf

    from tfgc.collectives import chunk_plan
    shape = tf.TensorShape(shape)
    return chunk_plan(compressor.chunk_recompression.chunk_layout(shape, n), shape, n)


def replay(n, spec):
    """The two stages, worker by worker: per step the outputs, at the end both residuals."""
    import tensorflow as tf

    from tfgc.compressors import CompressContext, ErrorFeedback, get

    compressor = get(spec)
    ef = isinstance(compressor, ErrorFeedback)
    base = compressor.inner if ef else compressor
    shared = spec == "terngrad"
    first = [[np.zeros(s, np.float32) for s in COMPRESSED] for _ in range(n)]
    # Momentum correction: each worker's velocity, compressed in place of its gradient.
    velocity = [[np.zeros(s, np.float32) for s in COMPRESSED] for _ in range(n)]
    m = MOMENTUM.get(spec, 0.0)
    # The owner's residual: its own chunk, flat (the store pads it to the longest).
    second = [[None] * len(COMPRESSED) for _ in range(n)]
    outputs = []
    for step in range(worker.STEPS):
        grads = [worker.gradients(w, step) for w in range(n)]
        outs = []
        for k, shape in enumerate(COMPRESSED):
            plan = plan_of(compressor, shape, n)
            for w in range(n):
                velocity[w][k] = (np.float32(m) * velocity[w][k] + grads[w][k]).astype(np.float32)
            flats = [velocity[w][k] if m else grads[w][k] for w in range(n)]
            if shared:
                flats = [base.clipped(tf.constant(f)).numpy() for f in flats]
                scale = max(np.abs(f).max() for f in flats)
            payloads = [[None] * n for _ in range(n)]  # [sender][chunk]
            for w in range(n):
                kept = []
                for c in range(n):
                    ctx = CompressContext(rank=w, num_workers=n, index=k * (n + 1) + c, step=step)
                    x = plan.take(tf.constant(flats[w]), c)
                    if ef:
                        p, _, r = base.compress_with_feedback(
                            x, plan.take(tf.constant(first[w][k]), c), {}, ctx)
                        kept.append(r)
                    elif shared:
                        p = base.compress_scaled(x, tf.constant(scale), ctx)
                    else:
                        p = base.compress(x, {}, ctx)[0]
                    payloads[w][c] = p
                if ef:
                    first[w][k] = plan.join(kept, shape).numpy()
            parts = []
            for c, (_, _, cshape) in enumerate(plan.chunks):
                ctx = CompressContext(rank=c, num_workers=n, index=k * (n + 1) + n, step=step)
                mine = [payloads[w][c] for w in range(n)]
                if shared:
                    parts.append(base.decode_counts(base.sum_codes(mine, cshape), cshape,
                                                    tf.float32, n))
                    continue
                total = base.aggregate(mine, cshape, tf.float32, ctx)
                if ef:
                    held = second[c][k] if second[c][k] is not None else np.zeros(cshape, np.float32)
                    p, _, r = base.compress_with_feedback(total, tf.constant(held), {}, ctx)
                    second[c][k] = r.numpy()
                else:
                    p = base.recompress(total, ctx)
                parts.append(base.decompress(p, cshape, tf.float32, ctx))
            outs.append(plan.join(parts, shape).numpy())
        outs.append(sum(grads[w][2] for w in range(n)))
        outputs.append(outs)
    return outputs, first, second, velocity


@pytest.mark.parametrize("j, spec", list(enumerate(worker.SPECS)))
def test_matches_replay_and_workers_agree(cluster, j, spec):
    n, _, runs = cluster
    expected, first, second, velocity = replay(n, spec)
    for step, outs in enumerate(expected):
        for k, want in enumerate(outs):
            got = runs[0][f"{j}_out{step}_{k}"]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{spec} step {step} tensor {k}")
            for r in range(1, n):
                np.testing.assert_array_equal(runs[r][f"{j}_out{step}_{k}"], got)
    if spec in EF_SPECS:
        for r in range(n):
            for k, shape in enumerate(COMPRESSED):
                np.testing.assert_allclose(runs[r][f"{j}_residual{k}"], first[r][k],
                                           rtol=1e-5, atol=1e-5)
                held = runs[r][f"{j}_server_residual{k}"]
                mine = second[r][k].ravel()
                np.testing.assert_allclose(held[:mine.size], mine, rtol=1e-5, atol=1e-5)
                assert not np.any(held[mine.size:])  # padding
                if spec in MOMENTUM:
                    np.testing.assert_allclose(runs[r][f"{j}_momentum{k}"], velocity[r][k],
                                               rtol=1e-6, atol=1e-6)


def onebit_numpy(v):
    """1-bit SGD of a [rows, cols] matrix: (decoded, residual), per column means."""
    pos = v >= 0
    mean1 = np.where(pos, v, 0).sum(0) / np.maximum(pos.sum(0), 1)
    mean0 = np.where(pos, 0, v).sum(0) / np.maximum((~pos).sum(0), 1)
    decoded = np.where(pos, mean1, mean0).astype(np.float32)
    return decoded, v - decoded


@pytest.mark.parametrize("spec", ["onebit", "onebit:momentum=0.9"])
def test_onebit_matches_numpy_model(cluster, spec):
    """Columns split among owners, 1-bit with error feedback at both stages, in NumPy;
    with momentum correction each worker compresses its velocity u <- 0.9 u + g."""
    n, _, runs = cluster
    j = worker.SPECS.index(spec)
    m = np.float32(MOMENTUM.get(spec, 0.0))
    rows, cols = COMPRESSED[0]
    # Columns dealt as evenly as possible, the first chunks one column wider.
    base, extra = divmod(cols, n)
    bounds = np.cumsum([0] + [base + (r < extra) for r in range(n)])
    e1 = [np.zeros((rows, cols), np.float32) for _ in range(n)]
    e2 = np.zeros((rows, cols), np.float32)
    u = [np.zeros((rows, cols), np.float32) for _ in range(n)]
    for step in range(worker.STEPS):
        for w in range(n):
            u[w] = m * u[w] + worker.gradients(w, step)[0]
        grads = u
        out = np.zeros((rows, cols), np.float32)
        for c in range(n):
            a, b = bounds[c], bounds[c + 1]
            total = np.zeros((rows, b - a), np.float32)
            for w in range(n):
                decoded, e1[w][:, a:b] = onebit_numpy(grads[w][:, a:b] + e1[w][:, a:b])
                total += decoded
            out[:, a:b], e2[:, a:b] = onebit_numpy(total + e2[:, a:b])
        np.testing.assert_allclose(runs[0][f"{j}_out{step}_0"], out, rtol=1e-4, atol=1e-5)


def test_non_finite_step_leaves_state_alone(cluster):
    """A NaN on one worker: compressed outputs NaN on every worker, both residuals and the
    step counter bit for bit as they were (the dense vector is summed as usual)."""
    n, _, runs = cluster
    for r in range(n):
        assert runs[r]["nan_outputs_all_nan"]
        assert runs[r]["nan_state_kept"]
        assert runs[r]["nan_dense_finite"]


def test_signsgd_is_the_majority_vote(cluster):
    """The owner counts every worker's vote: exactly sign(sum_w sign(g_w)), as the all-gather."""
    n, _, runs = cluster
    j = worker.SPECS.index("signsgd")
    for step in range(worker.STEPS):
        grads = [worker.gradients(w, step) for w in range(n)]
        for k in range(len(COMPRESSED)):
            vote = np.sign(sum(np.sign(grads[w][k]) for w in range(n)))
            np.testing.assert_array_equal(runs[0][f"{j}_out{step}_{k}"], vote)


def test_terngrad_sums_codes_exactly(cluster):
    """With the shared scaler s (the largest max |clip(g)|), every output is s times an
    integer in [-N, N]: the owners add the codes and send the sums whole."""
    n, _, runs = cluster
    j = worker.SPECS.index("terngrad")
    for step in range(worker.STEPS):
        for k in range(len(COMPRESSED)):
            grads = [worker.gradients(w, step)[k].astype(np.float64) for w in range(n)]
            scale = max(np.abs(np.clip(g, -2.5 * g.std(), 2.5 * g.std())).max() for g in grads)
            counts = runs[0][f"{j}_out{step}_{k}"] / scale
            np.testing.assert_allclose(counts, np.round(counts), atol=1e-4)
            assert np.abs(counts).max() <= n + 1e-4
            if k == 0:  # 512 elements: sums, not ternary again
                assert len(np.unique(np.round(counts))) > 3


@pytest.mark.parametrize("spec", ["fp16", "bf16"])
def test_16_bit_casts_sum_in_float32_and_round_once(cluster, spec):
    """Each worker's gradient rounded to 16 bits, the N of them summed in float32 in rank
    order by the chunk's owner, the sum rounded to 16 bits once: bit for bit."""
    import tensorflow as tf

    n, _, runs = cluster
    j = worker.SPECS.index(spec)
    wire = tf.float16 if spec == "fp16" else tf.bfloat16

    def rounded(x):
        return tf.cast(tf.cast(tf.constant(x, tf.float32), wire), tf.float32).numpy()

    for step in range(worker.STEPS):
        grads = [worker.gradients(w, step) for w in range(n)]
        for k in range(len(COMPRESSED)):
            total = rounded(grads[0][k])
            for w in range(1, n):
                total = (total + rounded(grads[w][k])).astype(np.float32)
            got = runs[0][f"{j}_out{step}_{k}"]
            np.testing.assert_array_equal(got, rounded(total), err_msg=f"step {step}")
            # Within half a 16-bit step of the exact sum of the rounded inputs.
            eps = 2.0 ** (-11 if spec == "fp16" else -8)
            assert np.all(np.abs(got - total) <= eps * np.abs(total) + 1e-7)


@pytest.mark.parametrize("spec", EF_SPECS)
def test_error_feedback_conserves_mass_at_both_stages(cluster, spec):
    """What was applied, plus every worker's two residuals, is every gradient ever sent."""
    from tfgc.compressors import get

    n, _, runs = cluster
    j = worker.SPECS.index(spec)
    for k, shape in enumerate(COMPRESSED):
        applied = sum(runs[0][f"{j}_out{s}_{k}"].astype(np.float64) for s in range(worker.STEPS))
        plan = plan_of(get(spec), shape, n)
        # Each owner's residual, padded flat, put back in its chunk's place.
        held = [runs[r][f"{j}_server_residual{k}"] for r in range(n)]
        owners = plan.join([h[:int(c.num_elements())] for h, (_, _, c) in zip(held, plan.chunks)],
                           shape).numpy().astype(np.float64)
        left = owners + sum(runs[r][f"{j}_residual{k}"].astype(np.float64) for r in range(n))
        # Under momentum correction what is sent is the velocities, u <- m u + g.
        m, total = MOMENTUM.get(spec, 0.0), 0.0
        for r in range(n):
            u = 0.0
            for s in range(worker.STEPS):
                u = m * u + worker.gradients(r, s)[k].astype(np.float64)
                total = total + u
        np.testing.assert_allclose(applied + left, total, rtol=1e-5, atol=1e-4)
    # Every owner keeps something of the large matrix (a chunk of the three-row one
    # may be sent exactly).
    for r in range(n):
        assert np.any(runs[r][f"{j}_server_residual0"] != 0)


def longest_chunks(spec, n):
    from tfgc.compressors import get
    return [max(int(cshape.num_elements()) for _, _, cshape in
                plan_of(get(spec), shape, n).chunks) for shape in COMPRESSED]


def chunk_words(spec, n):
    """Per tensor, the int32 words of the longest chunk's payload (the padded message width)."""
    from tfgc.compressors import get

    compressor = get(spec)
    widths = []
    for shape in COMPRESSED:
        plan = plan_of(compressor, shape, n).chunks
        longest = max(int(cshape.num_elements()) for _, _, cshape in plan)
        rows, cols = max((tuple(cshape.as_list()) for _, _, cshape in plan),
                         key=lambda s: s[0] * s[1])
        if spec.startswith("onebit"):
            widths.append(math.ceil(longest / 32) + 2 * cols)
        elif spec == "signsgd":
            widths.append(2 * math.ceil(longest / 32))
        elif spec == "efsignsgd":
            widths.append(1 + math.ceil(longest / 32))
        elif spec == "terngrad":
            widths.append(1 + math.ceil(2 * longest / 32))
        elif spec in ("fp16", "bf16"):
            widths.append(math.ceil(longest / 2))
        elif "rotate=true" in spec:  # 4 bits, buckets of 16, over the rotated length
            from tfgc.ops.rotation import padded_length
            coded = padded_length(longest, 16)
            widths.append(math.ceil(coded / 16) + math.ceil(4 * coded / 32))
        else:  # qsgd, 4 bits, buckets of 128
            widths.append(math.ceil(longest / 128) + math.ceil(4 * longest / 32))
    return widths


@pytest.mark.parametrize("spec", worker.SPECS)
def test_bytes_are_two_compressed_stages(cluster, spec):
    n, out, _ = cluster
    with open(out / "results.w0.json") as f:
        stats = json.load(f)["stats"][spec]
    width = sum(chunk_words(spec, n))
    second = width
    if spec == "terngrad":
        # The owners send exact sums of N codes: ceil(log2(2N + 1)) bits, as 4 here.
        second = sum(1 + math.ceil(4 * longest / 32) for longest in longest_chunks(spec, n))
    ring = lambda b: 2 * (n - 1) * b // n  # noqa: E731
    # One bucket per gradient. Stage 1: per bucket, N-1 messages of its padded
    # chunks and a rank tag; stage 2: the all-gather of the owners' padded chunks,
    # and the guard's 9 control words on the last bucket; the dense vector goes through the
    # ring all-reduce (TernGrad first gathers its 2 scalers).
    buckets = len(COMPRESSED)
    sent = (n - 1) * 4 * (width + buckets) + (n - 1) * 4 * (second + 9) + ring(4 * 40)
    if spec == "terngrad":
        sent += (n - 1) * 8
    assert stats["sent_bytes"] == sent
    dense = 4 * (16 * 32 + 3 * 10 + 40)
    assert stats["dense_sent_bytes"] == ring(dense)
    # The vector alone goes as it is (the policy leaves vectors out).
    assert stats["uncompressed_tensors"] == 1
    assert stats["uncompressed_bytes"] == 4 * 40
    # At most the dense all-reduce of the same gradients, and well under it for
    # the large matrix (1 to 8 bits for 32): the small ones pay their scales.
    assert stats["sent_bytes"] < stats["dense_sent_bytes"]


def test_fit_ends_identical_on_every_worker(cluster):
    n, out, _ = cluster
    assert_fit_identical_and_learning(out, n)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "ef+topk:ratio=0.01", "randomk", "none"])
def test_refused_for_compressors_that_cannot_recompress(spec):
    from tfgc.distribute.cross_device_ops import check_compression_args
    with pytest.raises(ValueError, match="`communication`='reduce_scatter'"):
        check_compression_args(spec, None, "reduce_scatter", 1 << 20)


def test_pair_rounds_meet_every_partner_once():
    from tfgc.collectives import pair_rounds
    for n in range(1, 10):
        met = {r: [] for r in range(n)}
        for matching in pair_rounds(n):
            for a, b in matching.items():
                assert matching[b] == a and a != b
                met[a].append(b)
        for r in range(n):
            assert sorted(met[r]) == [p for p in range(n) if p != r]
        assert len(pair_rounds(n)) == (0 if n == 1 else n - 1 if n % 2 == 0 else n)


def test_chunks_cut_at_units():
    import tensorflow as tf

    from tfgc.compressors import get

    def cuts(spec, shape, n):
        plan = plan_of(get(spec), shape, n)
        return plan.axis, [(a, b, s.as_list()) for a, b, s in plan.chunks]

    # 1-bit: whole columns, each keeping its two means over every row.
    assert cuts("onebit", [10, 4], 3) == (1, [(0, 2, [10, 2]), (2, 3, [10, 1]), (3, 4, [10, 1])])
    # Fewer columns than workers: row blocks.
    assert cuts("onebit", [9, 2], 3) == (0, [(0, 3, [3, 2]), (3, 6, [3, 2]), (6, 9, [3, 2])])
    # QSGD: whole buckets of the flat tensor, the last chunk takes the remainder.
    assert cuts("qsgd:bucket_size=128", [1000], 3) == \
        (1, [(0, 384, [1, 384]), (384, 768, [1, 384]), (768, 1000, [1, 232])])
    # Fewer buckets than workers: per element.
    assert cuts("qsgd:bucket_size=512", [1000], 3) == \
        (1, [(0, 334, [1, 334]), (334, 667, [1, 333]), (667, 1000, [1, 333])])
    # Chunks put back together give the tensor.
    plan = plan_of(get("onebit"), [10, 4], 3)
    x = tf.reshape(tf.range(40.0), [10, 4])
    np.testing.assert_array_equal(plan.join([plan.take(x, r) for r in range(3)], [10, 4]), x)
    np.testing.assert_array_equal(plan.take(x, 1), x[:, 2:3])
    # Row blocks and flat ranges are cut from the flat tensor.
    plan = plan_of(get("onebit"), [2048, 3], 2)
    assert plan.axis == 0 and [c.as_list() for _, _, c in plan.chunks] == [[1024, 3], [1024, 3]]
    x = tf.reshape(tf.range(2048.0 * 3), [2048, 3])
    np.testing.assert_array_equal(plan.take(x, 1), x[1024:])
    np.testing.assert_array_equal(plan.join([plan.take(x, r) for r in range(2)], [2048, 3]), x)


def test_auto_takes_the_reduce_scatter_for_error_feedback_only_with_momentum_correction():
    """Two residuals under the optimizer's momentum lose accuracy (the README's table), so
    auto keeps plain onebit on the all-gather; with the momentum on the workers it may go."""
    from tfgc.distribute.paths import auto as choice
    from tfgc.compressors import get

    assert choice.choose_communication(get("onebit"), 4)[0] == "allgather"
    assert choice.choose_communication(get("efsignsgd"), 4)[0] == "allgather"
    assert choice.choose_communication(get("onebit:momentum=0.9"), 4)[0] == "reduce_scatter"
    assert choice.choose_communication(get("efsignsgd:momentum=0.9"), 8)[0] == "reduce_scatter"
    # Two workers tie on bytes and quantize twice: the all-gather stays.
    assert choice.choose_communication(get("onebit:momentum=0.9"), 2)[0] == "allgather"
    # Top-k cannot be compressed again, momentum or not.
    assert choice.choose_communication(get("ef+topk:ratio=0.01,momentum=0.9"), 4)[0] == "allgather"
