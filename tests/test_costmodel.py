"""The alpha-beta model of the reduction paths (``tfgc.distribute.costmodel``) against
the collectives' own schedules and byte counts, and the planner at scale."""

import math

import pytest
import tensorflow as tf

from tfgc.collectives import reduce_scatter
from tfgc.compressors import get as get_compressor
from tfgc.distribute import costmodel, planner
from tfgc.distribute.paths import auto as auto_paths
from tfgc.distribute.paths import guard

NS = [1, 2, 3, 4, 5, 7, 8, 16, 33, 1024]


@pytest.mark.parametrize("n", NS)
def test_hops_follow_the_collectives_schedules(n):
    assert costmodel.hops("allreduce", n) == (2 * (n - 1) if n > 1 else 0)
    assert costmodel.hops("allgather", n) == max(n - 1, 0)
    # PowerSGD's P then Q, the shared index set then its values: two rings in a row.
    assert costmodel.hops("low_rank", n) == costmodel.hops("shared_index", n) == \
        2 * costmodel.hops("allreduce", n)
    # The reduce-scatter's first stage is the tournament the collective really plays.
    rounds = len(reduce_scatter.pair_rounds(n))
    assert costmodel.pair_rounds(n) == rounds
    assert costmodel.hops("reduce_scatter", n) == (rounds + n - 1 if n > 1 else 0)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64])
def test_bytes_agree_with_the_paths_own_count(n):
    compressor = get_compressor("qsgd:levels=7,bucket_size=128,norm=max,rotate=true")
    shape = tf.TensorShape([512, 1024])
    words = auto_paths._payload_words(compressor, shape, tf.float32)
    # The all-gather: every other worker's whole payload (with the guard's control words).
    payload = 4 * (words + guard.CONTROL_WORDS)
    assert auto_paths.sent_bytes("allgather", compressor, [(shape, tf.float32)], n) == \
        costmodel.sent("allgather", n, payload)
    # The reduce-scatter: 2(N-1)/N of it, plus each chunk's own scale words and headers.
    counted = auto_paths.sent_bytes("reduce_scatter", compressor, [(shape, tf.float32)], n)
    modelled = costmodel.sent("reduce_scatter", n, payload)
    assert modelled <= counted <= modelled * 1.02 + 64 * (n - 1)


def test_the_all_reduce_sends_what_a_ring_sends():
    for n in (2, 3, 8, 1024):
        assert costmodel.sent("allreduce", n, 4000) == pytest.approx(2 * (n - 1) / n * 4000)
        assert costmodel.sent("allreduce", n, 4000) == planner.ring_sent(4000, n)
    assert costmodel.sent("allgather", 1, 4000) == 0.0


@pytest.mark.parametrize("n", [2, 3, 8, 1024])
def test_decoded_elements_grow_with_n_on_the_all_gather_and_calls_on_the_reduce_scatter(n):
    def total(path):
        enc, dec = costmodel.codec_calls(path, n, 1000.0)
        return sum(c * e for c, e in enc), sum(c * e for c, e in dec), \
            sum(c for c, _ in enc + dec)

    assert total("allgather") == (1000.0, n * 1000.0, 2)  # N payloads, one fused sum
    enc, dec, calls = total("reduce_scatter")
    assert enc == pytest.approx(1000.0 + 1000.0 / n)  # N chunks, and the owner's sum
    assert dec == pytest.approx(2000.0)  # the owner's N chunks, and the N owners' chunks
    assert calls == (n + 1) + 1 + n  # a call per chunk: the fixed costs add up with N
    # Lines with a fixed cost per call and a cost per element.
    seconds = costmodel.codec_seconds("reduce_scatter", n, 1000.0,
                                      lambda e: 1.0 + e, lambda e: 2.0 + 3 * e)
    assert seconds == pytest.approx((n + 1) * 1.0 + enc + (n + 1) * 2.0 + 3 * dec)


def test_the_link_of_a_measured_all_reduce_predicts_it_back():
    for n in (2, 3, 4, 8):
        link = costmodel.AlphaBeta.from_allreduce(6e-3, 1e-8, n)
        assert link.alpha == pytest.approx(6e-3 / (2 * (n - 1)))
        assert link.time("allreduce", n, 1e6) == pytest.approx(
            6e-3 + 1e-8 * 2 * (n - 1) / n * 1e6)
    given = costmodel.AlphaBeta.from_rate(10.0, 50.0)
    assert given.alpha == pytest.approx(50e-6) and given.beta == pytest.approx(0.8e-9)
    # Latency grows with the hops, the all-gather's wire with N, the ring's not.
    assert given.latency("allreduce", 1024) == pytest.approx(2046 * 50e-6)
    assert given.wire("allgather", 1024, 1000) == pytest.approx(1023 * 1000 * 0.8e-9)
    assert given.wire("allreduce", 1024, 1000) < 2 * 1000 * 0.8e-9


@pytest.mark.parametrize("call, match", [
    (lambda: costmodel.hops("ring", 4), "path 'ring'"),
    (lambda: costmodel.hops("allreduce", 0), "num_workers"),
    (lambda: costmodel.sent("allgather", 2.5, 10), "num_workers"),
    (lambda: costmodel.codec_calls("sparse_allreduce", 4, 10), "path 'sparse_allreduce'"),
    (lambda: costmodel.AlphaBeta.from_rate(0.0, 50.0), "rate"),
    (lambda: costmodel.AlphaBeta.from_rate(1.0, -1.0), "latency"),
])
def test_bad_arguments_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _resnet_like():
    """Conv kernels of ResNet-50's stages and its classifier (shapes only)."""
    shapes = [(7, 7, 3, 64), (1, 1, 64, 256), (3, 3, 128, 128), (1, 1, 256, 512),
              (3, 3, 256, 256), (1, 1, 1024, 2048), (3, 3, 512, 512), (2048, 1000)]
    return [(f"k{i}", s, "float32") for i, s in enumerate(shapes)]


def test_at_a_thousand_workers_the_plan_pays_each_groups_hops():
    layers = _resnet_like()
    figures = dict(encode_us={}, decode_us={})
    for label in (c.label for c in planner.CANDIDATES[1:]):
        figures["encode_us"][label] = tuple(int(0.5e-3 * s) + 5 for s in planner.CPU_SIZES)
        figures["decode_us"][label] = tuple(int(0.5e-3 * s) + 5 for s in planner.CPU_SIZES)
    plans = {}
    for n in (4, 1024):
        fig = planner.Figures(n, (0, 0, 0), figures["encode_us"], figures["decode_us"],
                              link_gbps=1.0, latency_ms=0.05)
        plan = planner.make_plan(layers, fig, 0.05)
        groups = {e.label: e.path for e in plan.entries if e.label != "fp32"}
        assert all(path == "reduce_scatter" for label, path in groups.items()
                   if label != "bf16")
        p = plan.predicted()
        assert p["latency_s"] == pytest.approx(sum(
            50e-6 * costmodel.hops(path, n) for path in groups.values()))
        # Compressed on a 1 Gbit/s link: less wire than float32 at any N.
        assert p["wire_s"] < p["fp32_wire_s"] / 2
        plans[n] = plan
    # The ring's latency at 1024 workers (2046 hops) is a tenth of a second.
    assert plans[1024].predicted()["fp32_latency_s"] == pytest.approx(2046 * 50e-6)
    assert math.isclose(plans[4].predicted()["fp32_latency_s"], 6 * 50e-6)


def test_a_small_group_pays_more_hops_on_more_workers_and_joins_float32():
    # A large kernel and a small one on a slow link with 20 us per hop: on 4 workers the
    # small one's own group (6 hops on the reduce-scatter) costs less than its 4 bits
    # save; on 64 the hops of any group of its own (126 on a ring all-reduce) cost more,
    # and it rides as float32 with the biases' all-reduce.
    from test_auto import figures

    layers = [("big", (2048, 2048), "float32"), ("small", (512, 10), "float32")]
    four = planner.make_plan(layers, figures(num_workers=4, link_gbps=0.1, latency_ms=0.02),
                             0.0004)
    assert [(e.label, e.path) for e in four.entries] == [
        ("rqsgd8", "reduce_scatter"), ("rqsgd4", "reduce_scatter")]
    many = planner.make_plan(layers, figures(num_workers=64, link_gbps=0.1,
                                             latency_ms=0.02), 0.0004)
    assert [e.label for e in many.entries] == ["rqsgd8", "fp32"]
    assert many.entries[1].reason == "its group saves less than its own collectives cost"
    # Without latency it keeps a group of its own there too.
    free = planner.make_plan(layers, figures(num_workers=64, link_gbps=0.1, latency_ms=1e-9),
                             0.0004)
    assert free.entries[1].label != "fp32"
