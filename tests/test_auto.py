"""``compressor="auto"``: the per-gradient plan.

* the planner on given figures (no cluster): a slow link compresses more and a fast
  one less, the error budget holds, the same figures give the same plan, and more
  budget never predicts a slower step;
* the candidates' variance bounds, which the budget trusts, hold on real draws;
* bad settings fail at construction, naming the argument;
* a real 2-worker cluster (``tests/cluster/auto_plan.py``, one launch): every worker
  derives the same plan, a mixed plan sends each gradient as its candidate does
  (float32 exactly, bf16 as a bf16 ring sums, 8-bit QSGD unbiased within its bound),
  the bytes counted match the plan's, the MLP learns under a measured plan, the link
  is measured again on demand, and ``AutoPlanCallback`` marks critical regimes by
  ACCORDION's rule and plans them with bf16's error at most.
"""

import dataclasses
import json
import logging
import math
import time

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from cluster_scripts import assert_fit_identical_and_learning, cluster_script, run_cluster
from tfgc.compressors import get as get_compressor
from tfgc.distribute import autoplan, embeddings, planner

SCRIPT, worker = cluster_script("auto_plan")

# A model's planned gradients: a few large kernels and some small ones.
GRADIENTS = [("embed", (4096, 512), "float32"), ("fc1", (2048, 2048), "float32"),
             ("fc2", (2048, 512), "float32"), ("conv", (3, 3, 64, 64), "float32"),
             ("head", (512, 10), "float32")]


def figures(num_workers=4, link_gbps=1.0, latency_ms=0.1, ns_per_element=2.0, rotation=1.0):
    """Figures as ``measure`` would agree on: every candidate encodes and decodes at
    ``ns_per_element`` (the rotated ones ``rotation`` times that) plus 50 us; the link
    as given."""
    def cpu(label):
        ns = ns_per_element * (rotation if label.startswith("r") else 1.0)
        return tuple(int(50 + ns * size / 1e3) for size in planner.CPU_SIZES)

    labels = [c.label for c in planner.CANDIDATES[1:]]
    return planner.Figures(num_workers, (0,) * len(planner.LINK_SIZES),
                           {label: cpu(label) for label in labels},
                           {label: cpu(label) for label in labels}, link_gbps, latency_ms)


def compressed_share(plan):
    """The planned elements' share sent other than as float32."""
    sizes = [int(np.prod(e.shape)) for e in plan.entries]
    return sum(s for s, e in zip(sizes, plan.entries) if e.label != "fp32") / sum(sizes)


def predicted_seconds(plan):
    return sum(e.cpu_s + e.wire_s for e in plan.entries)


# -- the planner ----------------------------------------------------------------------

def test_a_slow_link_compresses_more_and_a_fast_one_less():
    shares = [compressed_share(planner.make_plan(GRADIENTS, figures(link_gbps=rate), 0.05))
              for rate in (0.1, 1.0, 10.0, 1000.0)]
    assert shares[0] == 1.0  # at 100 Mbit/s every kernel is worth compressing
    assert shares[-1] == 0.0  # at 1 Tbit/s the CPU costs more than the wire saves
    assert all(a >= b for a, b in zip(shares, shares[1:])), shares
    # 4 bits everywhere need a budget over the rotated 4-bit bound (0.068): more
    # budget, fewer bytes. At equal CPU costs rotated 8 bits beat plain 8 bits (the
    # same bytes, less error).
    tight = planner.make_plan(GRADIENTS, figures(link_gbps=0.1), 0.001)
    loose = planner.make_plan(GRADIENTS, figures(link_gbps=0.1), 0.07)
    assert {e.label for e in tight.entries} <= {"rqsgd8", "rqsgd4"}
    assert sum(int(np.prod(e.shape)) for e in tight.entries if e.label == "rqsgd8") > \
        0.9 * sum(int(np.prod(e.shape)) for e in tight.entries)
    assert {e.label for e in loose.entries} == {"rqsgd4"}
    assert sum(e.sent_bytes for e in loose.entries) < sum(e.sent_bytes for e in tight.entries)


@pytest.mark.parametrize("budget", [0.0, 1e-5, 0.003, 0.02, 0.05, 0.3, 1.0])
def test_the_error_budget_holds_and_more_budget_is_never_slower(budget):
    plan = planner.make_plan(GRADIENTS, figures(link_gbps=0.1), budget)
    assert plan.mean_error <= budget + 1e-12
    if budget == 0.0:
        assert {e.label for e in plan.entries} == {"fp32"}
        assert all(e.reason == "the error budget" for e in plan.entries)
    more = planner.make_plan(GRADIENTS, figures(link_gbps=0.1), budget * 2 + 1e-4)
    assert predicted_seconds(more) <= predicted_seconds(plan) + 1e-12


def test_equal_layers_share_a_budget_that_fits_only_some_of_them():
    # Four equal kernels: each saves the same time per error, so the Lagrangian
    # multiplier switches all or none; the budget fits 4 bits on two of them, and
    # rotated 8 bits on the others.
    layers = [(f"fc{i}", (1024, 1024), "float32") for i in range(4)]
    bound = planner.BY_LABEL["rqsgd4"].variance_bound(1 << 20)
    plan = planner.make_plan(layers, figures(link_gbps=0.1), 2.5 * bound / 4)
    assert sorted(e.label for e in plan.entries) == ["rqsgd4", "rqsgd4", "rqsgd8", "rqsgd8"]
    assert plan.mean_error <= 2.5 * bound / 4


@pytest.mark.parametrize("budget", [0.0005, 0.02, 0.05, 0.06])
@pytest.mark.parametrize("ns, rotation", [(0.5, 1.0), (3.0, 1.0), (1.0, 2.0), (10.0, 2.0)])
def test_the_plan_is_the_fastest_assignment_within_the_budget(budget, ns, rotation):
    # Every assignment of candidates to three gradients, by brute force: the plan is
    # no slower than the fastest that fits the budget (less the program's rounding of
    # errors up to whole bins), though the per-gradient relaxation alone can miss it
    # (4 bits on the middle kernel while the large one takes 8, or the other way).
    import itertools

    layers = [("a", (784, 2048), "float32"), ("b", (2048, 2048), "float32"),
              ("c", (2048, 10), "float32")]
    fig = figures(num_workers=2, link_gbps=0.1, latency_ms=1e-9, ns_per_element=ns,
                  rotation=rotation)
    plan = planner.make_plan(layers, fig, budget)
    total = sum(int(np.prod(shape)) for _, shape, _ in layers)
    costs = []
    for name, shape, dtype in layers:
        n = int(np.prod(shape))
        mine = []
        for c in planner.CANDIDATES:
            path = planner.path_of(c, 2)
            mine.append((planner.cpu_seconds(fig, c, path, n) + planner.sent_bytes(
                c, path, shape, dtype, 2) * fig.link().beta, c.variance_bound(n) * n / total))
        costs.append(mine)
    slack = len(layers) / 4096 * budget
    best = min(sum(t for t, _ in combo) for combo in itertools.product(*costs)
               if sum(e for _, e in combo) <= budget - slack)
    assert plan.mean_error <= budget + 1e-12
    assert predicted_seconds(plan) <= best + 1e-12


def test_a_group_that_saves_less_than_its_collectives_cost_joins_another():
    # A large kernel best in 8 bits and a small one best in 4 (fewer bytes): with
    # no latency each takes its own; when the hops of its collectives cost more than
    # what 4 bits save on the small one, it goes with the large one.
    layers = [("big", (2048, 2048), "float32"), ("small", (512, 10), "float32")]
    # Rotated 8 bits on the big one (0.00025 of nearly all the elements) and 4 on the
    # small one (0.068 of 0.12 % of them) fit within 0.0004; 4 bits on the big one do not.
    apart = planner.make_plan(layers, figures(link_gbps=0.1, latency_ms=1e-9), 0.0004)
    assert [e.label for e in apart.entries] == ["rqsgd8", "rqsgd4"]
    together = planner.make_plan(layers, figures(link_gbps=0.1, latency_ms=20.0), 0.0004)
    assert [e.label for e in together.entries] == ["rqsgd8", "rqsgd8"]
    p = together.predicted()
    # One group on the reduce-scatter: 3 rounds of pairwise exchanges and a ring
    # all-gather's 3 hops on 4 workers.
    assert p["latency_s"] == pytest.approx(6 * 20e-3)


def test_critical_gradients_take_no_more_error_than_bf16():
    critical = {"fc1", "head"}
    plan = planner.make_plan(GRADIENTS, figures(link_gbps=0.1), 2.0, critical=critical)
    for e in plan.entries:
        assert e.critical == (e.name in critical)
        if e.critical:
            assert e.label in ("fp32", "bf16")
        else:
            assert e.label == "rqsgd4"


def test_the_same_figures_give_the_same_plan_and_others_another():
    a = planner.make_plan(GRADIENTS, figures(link_gbps=0.5), 0.02)
    b = planner.make_plan(list(GRADIENTS), figures(link_gbps=0.5), 0.02)
    assert a.key() == b.key() and a.digest() == b.digest()
    c = planner.make_plan(GRADIENTS, figures(link_gbps=1000.0), 0.02)
    assert c.digest() != a.digest()


def test_each_gradient_takes_its_cheapest_candidate_when_the_budget_allows():
    # No latency: no group costs anything of its own.
    fig = figures(link_gbps=1.0, latency_ms=1e-9)
    plan = planner.make_plan(GRADIENTS, fig, 10.0)
    for entry in plan.entries:
        times = {}
        for candidate in planner.CANDIDATES:
            path = planner.path_of(candidate, 4)
            times[candidate.label] = planner.cpu_seconds(
                fig, candidate, path, int(np.prod(entry.shape))) + planner.sent_bytes(
                    candidate, path, entry.shape, entry.dtype, 4) * plan.link.beta
        assert times[entry.label] == min(times.values()), (entry, times)


def test_the_bytes_each_path_sends_are_counted_as_the_path_counts_them():
    fig = figures(num_workers=4, link_gbps=0.1)
    plan = planner.make_plan([("k", (1024, 256), "float32")], fig, 0.05)
    (entry,) = plan.entries
    assert (entry.label, entry.path) == ("rqsgd8", "reduce_scatter")
    n = 1024 * 256
    # 8 bits per element and a float32 per 512 elements, in 2(N-1)/N of it, plus the
    # per-chunk headers and control words: within 1 % of the ideal.
    ideal = 2 * 3 / 4 * (n + 4 * n / 512)
    assert ideal <= entry.sent_bytes <= 1.01 * ideal
    dense = planner.make_plan([("k", (1024, 256), "float32")], fig, 0.0).entries[0]
    assert dense.sent_bytes == 2 * 3 / 4 * 4 * n


def test_the_link_line_comes_back_from_exact_timings():
    # An all-reduce at 1 Gbit/s per worker with 2 ms of latency, 4 workers.
    us = tuple(int(round((2e-3 + planner.ring_sent(s, 4) * 8 / 1e9) * 1e6))
               for s in planner.LINK_SIZES)
    fig = planner.Figures(4, us, {}, {})
    link = fig.link()
    # The all-reduce's latency is its 2(N-1) = 6 hops'.
    assert link.alpha == pytest.approx(2e-3 / 6, rel=0.01)
    assert link.beta == pytest.approx(8e-9, rel=0.01)
    # A noisy fast link cannot give a negative latency or rate.
    flat = planner.fit([1, 2, 3], [5.0, 1.0, 0.5])
    assert flat.a >= 0 and flat.b >= 0
    for xs, ys in (([1, 2, 3], [5.0, 1.0, 0.5]), ([1, 2, 3], [0.0, 4.0, 5.0])):
        line = planner.link_line(xs, ys)
        assert line.a >= 0 and line.b >= 0


def test_figures_stored_before_the_small_probe_read_as_they_were():
    # The benchmarks' stored words: three link sizes, then the candidates' blocks.
    old_sizes = planner.EARLIER_LINK_SIZES
    us = [int(round((2e-3 + planner.ring_sent(s, 4) * 8 / 1e9) * 1e6)) for s in old_sizes]
    words = us + list(range(1, 2 * len(planner.CPU_SIZES) * (len(planner.CANDIDATES) - 1) + 1))
    fig = planner.Figures.from_words(words, 4)
    assert fig.link_us == tuple(us) and fig.encode_us["bf16"] == (1, 3, 5)
    assert fig.link().alpha == pytest.approx(2e-3 / 6, rel=0.01)
    assert fig.link().beta == pytest.approx(8e-9, rel=0.01)


def test_the_links_latency_is_its_smallest_probes_where_large_messages_set_the_slope():
    # 2 workers at 100 Mbit/s with 1.5 ms a hop behind a token-bucket shaper whose
    # 64 KB burst goes at ten times the rate (the benchmarks' links): every message gets
    # its first 64 KB nearly free, so the large messages' line meets zero bytes 5 ms
    # low. The latency comes from the 256-byte probe, the rate from the large ones.
    n, alpha, beta, burst = 2, 1.5e-3, 8 / 100e6, 64 << 10
    hops = 2 * (n - 1)

    def seconds(size):
        sent = planner.ring_sent(size, n)
        return hops * alpha + min(sent, burst) * beta / 10 + max(sent - burst, 0) * beta

    us = tuple(int(round(seconds(s) * 1e6)) for s in planner.LINK_SIZES)
    link = planner.Figures(n, us, {}, {}).link()
    assert link.alpha == pytest.approx(alpha, rel=0.01)
    assert link.beta == pytest.approx(beta, rel=0.03)  # the burst's share of 4 MB
    # A least-squares line through every point puts the latency far lower.
    sent = [planner.ring_sent(s, n) for s in planner.LINK_SIZES]
    assert planner.fit(sent, [u / 1e6 for u in us]).a / hops < alpha / 2


class _LinedUpLink:
    """What ``planner.measure_link`` asks of the cross-device ops, for one worker of 4 on
    an exact link: the group's size, an all-reduce's time (``latency_s`` plus the ring's
    bytes at ``gbps``), and the gathered words (this worker's alone)."""

    group_size = 4

    def __init__(self, gbps, latency_s=2e-3):
        self.gbps, self.latency_s, self.probed, self.repeats = gbps, latency_s, [], []

    def time_all_reduce(self, nbytes, repeats=planner.REPEATS):
        self.probed.append(nbytes)
        self.repeats.append(repeats)
        return self.latency_s + planner.ring_sent(nbytes, 4) * 8 / (self.gbps * 1e9)

    def gather_words(self, words):
        return np.asarray([words])


def exact_link_figures(gbps, latency_s=2e-3):
    us = tuple(int(round((latency_s + planner.ring_sent(s, 4) * 8 / (gbps * 1e9)) * 1e6))
               for s in planner.LINK_SIZES)
    return planner.Figures(4, us, {}, {})


@pytest.mark.parametrize("before, now, probed", [(10.0, 10.0, 4), (0.1, 0.1, 3), (0.1, 0.05, 4),
                                                 (0.1, 1.0, 4), (0.1, 0.11, 3)])
def test_the_link_is_measured_again_with_a_probe_it_can_afford(before, now, probed):
    # On a slow link the largest size (whose all-reduce the old figures put above
    # REPROBE_S) is left out and its time follows the largest size probed; unless that
    # moved by more than REPROBE_MARGIN, when every size is timed again.
    ops = _LinedUpLink(now)
    old = exact_link_figures(before)
    new = planner.measure_link(ops, old)
    assert ops.probed == list(planner.LINK_SIZES)[:probed]
    # The line's anchor, the smallest size, timed more often than the others.
    assert ops.repeats == [planner.LATENCY_REPEATS] + [planner.REPEATS] * (probed - 1)
    assert planner.LATENCY_REPEATS > planner.REPEATS
    want = exact_link_figures(now)
    if probed == len(planner.LINK_SIZES):
        np.testing.assert_allclose(new.link_us, want.link_us, rtol=1e-3, atol=2)
    else:  # scaled: the same link gives the same figures, a small change about its ratio
        np.testing.assert_allclose(new.link_us[:3], want.link_us[:3], rtol=1e-3, atol=2)
        assert new.link().beta == pytest.approx(want.link().beta, rel=0.03)


def test_a_link_change_counts_when_the_predicted_all_reduce_moves_by_the_margin():
    plan = planner.make_plan(GRADIENTS, figures(link_gbps=1.0), 0.05)
    same = figures(link_gbps=1.0)
    slower = figures(link_gbps=0.7)  # the float32 all-reduce takes 1/0.7 = 1.43x as long
    assert not planner.link_changed(same, same, plan, 0.0)
    assert planner.link_changed(same, slower, plan, 0.25)
    assert not planner.link_changed(same, slower, plan, 0.5)
    assert planner.link_changed(slower, same, plan, 0.25)  # faster counts too


def test_accordions_rule_marks_a_layer_whose_norm_moved_by_half():
    previous = {"a": 2.0, "b": 2.0, "c": 2.0, "d": 0.0}
    current = {"a": 2.9, "b": 1.0, "c": 3.0, "d": 1.0, "e": 1.0, "f": float("nan")}
    # a moved by 45 %, b by 50 %, c by 50 %; d had no norm, e no previous interval,
    # f is not finite.
    assert planner.critical_layers(previous, current, 0.5) == {"b", "c", "d", "e", "f"}
    assert planner.critical_layers({}, {"a": 1.0}, 0.5) == {"a"}


def test_an_intervals_norm_is_its_means_with_the_noise_of_independent_steps():
    steps = np.random.default_rng(3).normal(size=(7, 50))
    total = steps.sum(0)
    mean, noise, level = planner.interval_norm(float(np.linalg.norm(total)),
                                               float((steps ** 2).sum()), len(steps))
    assert mean == pytest.approx(np.linalg.norm(steps.mean(0)))
    # The entries' sample variances summed: the level squared; over the steps: the
    # mean's noise squared.
    assert level ** 2 == pytest.approx(steps.var(0, ddof=1).sum())
    assert noise ** 2 == pytest.approx(level ** 2 / len(steps))
    # The same step every time: no noise; one step: unknown (noise 0, no level); none:
    # no mean.
    assert planner.interval_norm(6.0, 3 * 4.0, 3) == pytest.approx((2.0, 0.0, 0.0), abs=1e-9)
    one = planner.interval_norm(2.0, 4.0, 1)
    assert one[:2] == (2.0, 0.0) and math.isnan(one[2])
    assert math.isnan(planner.interval_norm(0.0, 0.0, 0)[0])


def test_a_move_within_the_two_intervals_noise_is_not_a_regime_unless_the_level_moved():
    previous = {"a": (2.0, 0.6), "b": (2.0, 0.6), "c": (2.0, 0.0), "d": (2.0, 0.6),
                "e": (2.0, 0.6, 3.0), "f": (2.0, 0.6, 3.0), "g": (2.0, 0.6, 3.0),
                "h": (2.0, 0.05, 3.0)}
    current = {"a": (1.0, 0.8), "b": (0.9, 0.8), "c": 1.0, "d": (3.0, 0.0),
               "e": (1.0, 0.8, 1.5), "f": (1.0, 0.8, 1.6), "g": (1.0, 0.8, float("nan")),
               "h": (1.6, 0.05, 1.0)}
    # a fell by 1.0 = hypot(0.6, 0.8), no more; b by 1.1; c has no noise; d rose by 1.0,
    # beyond the previous noise alone. The noise of e, f and g could hide a move of the
    # mean by half (1.0 >= 0.5 * 2.0): e's level fell by half, f's by less, g's is
    # unknown. h's level fell by two thirds, but its noise (0.07) hides no move of
    # half its mean: its mean's 20 % decides.
    assert planner.critical_layers(previous, current, 0.5) == {"b", "c", "d", "e"}
    assert planner.critical_layers(previous, current, 0.5, noise=0.0) == \
        set(current) - {"h"}
    assert planner.critical_layers(previous, current, 0.5, noise=2.0) == {"c", "e"}
    assert planner.critical_layers(previous, current, 0.6) == set()  # none moved 60 %
    mean, spread = planner.MEAN_MOVED, planner.SPREAD_MOVED
    assert planner.critical_reasons(previous, current, 0.5) == \
        {"b": mean, "c": mean, "d": mean, "e": spread}
    assert planner.critical_reasons({}, {"a": 1.0, "b": (2.0, 0.1, 1.0)}, 0.5) == \
        {"a": planner.NO_PREVIOUS, "b": planner.NO_PREVIOUS}


def test_the_noise_test_holds_still_where_only_the_draw_of_the_noise_moves():
    # A gradient of small fixed mean and noise in 4 directions, intervals of 25 steps: the
    # norm of the mean's noise is sigma / 5 * sqrt(chi2_4), whose draws differ by half
    # or more about a third of the time (sqrt(chi2_4): mean 1.88, sd 0.7), which
    # ACCORDION's bare test calls a regime; beyond the two noises' sqrt(2) * 2 sigma / 5
    # (a difference of 2.8 in sqrt(chi2_4), 2.8 sd) and with the level (the average of
    # 25 steps' spread: sd about a tenth) still, about 1 % of the time. A level that
    # falls to a third (early training's), or a mean that does under little noise, is a
    # regime every time.
    rng = np.random.default_rng(0)
    dims, directions, n = 2000, 4, 25
    basis = np.linalg.qr(rng.normal(size=(dims, directions)))[0].T
    mu = np.full(dims, 0.003 / math.sqrt(dims))

    def norm(mean, sigma):
        steps = mean + sigma * rng.normal(size=(n, directions)) @ basis
        return planner.interval_norm(float(np.linalg.norm(steps.sum(0))),
                                     float((steps ** 2).sum()), n)

    draws = [({"g": norm(mu, 0.05)}, {"g": norm(mu, 0.05)}) for _ in range(400)]
    bare = sum(len(planner.critical_layers(a, b, 0.5, noise=0.0)) for a, b in draws)
    kept = sum(len(planner.critical_layers(a, b, 0.5)) for a, b in draws)
    assert bare >= 0.2 * len(draws) and kept <= 0.03 * len(draws), (bare, kept)
    for _ in range(50):
        assert planner.critical_layers({"g": norm(mu, 0.05)}, {"g": norm(mu, 0.05 / 3)},
                                       0.5) == {"g"}
        assert planner.critical_layers({"g": norm(30 * mu, 0.001)},
                                       {"g": norm(10 * mu, 0.001)}, 0.5) == {"g"}


def test_adapt_takes_each_planned_gradients_mean_and_noise_from_the_steps_it_summed(caplog):
    # One worker and a learning rate of 0: the weights stay, so each step's gradient is
    # the one a tape gives on its batch; worker 0's (mean, noise, level) at the
    # interval's end is that of those steps.
    import tf_keras as keras
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    cdo = strategy.cross_device_ops
    cdo.track_regimes()
    model = small_model(strategy)
    model.optimizer.learning_rate.assign(0.0)
    x, y = small_data(32)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    cdo.adapt(0.5)
    lay, = cdo._auto._layouts.values()  # pylint: disable=protected-access
    names = [g[0] for g in lay.gradients]
    loss_fn = keras.losses.MeanSquaredError()
    steps = []
    for k in range(4):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[8 * k:8 * k + 8], model(x[8 * k:8 * k + 8]))
        grads = tape.gradient(loss, model.trainable_variables)
        steps.append({v.name: g.numpy().astype(np.float64).ravel()
                      for v, g in zip(model.trainable_variables, grads)})
    assert lay.norms and set(lay.norms) <= set(range(len(names)))
    for j, (mean, noise, level) in lay.norms.items():
        each = np.stack([s[names[j]] for s in steps])
        assert mean == pytest.approx(np.linalg.norm(each.mean(0)), rel=1e-4), names[j]
        assert level == pytest.approx(math.sqrt(each.var(0, ddof=1).sum()), rel=1e-3)
        assert noise == pytest.approx(level / 2, rel=1e-6)
    # Kept in the checkpoint's record as (mean, noise, level); a record from before the
    # noise was kept (bare norms of the sums) restores none: the next interval is
    # critical.
    part = json.loads(json.dumps(cdo._auto.snapshot()["layouts"][0]))  # pylint: disable=protected-access
    kept = dict(lay.norms)
    lay.norms = {}
    autoplan.AutoPlanner._take_part(lay, part)  # pylint: disable=protected-access
    assert lay.norms == kept  # JSON keeps a float's every digit
    part["norms"] = {k: v[0] * 4 for k, v in part["norms"].items()}
    autoplan.AutoPlanner._take_part(lay, part)  # pylint: disable=protected-access
    assert lay.norms == {}
    # With norms to compare, the next interval's end says how many are critical, and why.
    lay.norms = kept
    with caplog.at_level(logging.INFO):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        critical = cdo.adapt(0.5)
    said = [r.getMessage() for r in caplog.records
            if "gradients critical at the interval's end" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        f"tfgc: compressor='auto': {len(critical)} of {len(names)} gradients"), said
    with pytest.raises(ValueError, match="`noise`"):
        cdo.adapt(0.5, noise=-1.0)


def test_accordions_rule_at_a_decay_asks_the_learning_rate_to_fall_by_the_threshold():
    assert planner.learning_rate_fell(0.1, 0.01, 0.5)  # a step decay
    assert planner.learning_rate_fell(0.1, 0.05, 0.5)  # by exactly the threshold
    assert not planner.learning_rate_fell(0.1, 0.051, 0.5)
    assert not planner.learning_rate_fell(0.1, 0.2, 0.5)  # a warm-up's rise
    assert planner.learning_rate_fell(0.1, 0.0, 0.5)
    for before, now in [(None, 0.01), (0.1, None), (0.0, 0.0), (float("nan"), 0.01),
                        (0.1, float("nan")), (float("inf"), 0.1)]:
        assert not planner.learning_rate_fell(before, now, 0.5)
    # A cosine decay over 8 intervals falls by half or more only over its last three
    # (ends at 6/8 and 7/8 and the end: 53 %, 74 %, 100 %); 38 % at 5/8.
    rates = [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]
    fell = [k for k in range(1, 9) if planner.learning_rate_fell(rates[k - 1], rates[k], 0.5)]
    assert fell == [6, 7, 8]


def test_figures_round_trip_through_the_words_the_workers_gather():
    compressing = len(planner.CANDIDATES) - 1
    words = list(range(1, len(planner.LINK_SIZES) + 2 * len(planner.CPU_SIZES) * compressing + 1))
    fig = planner.Figures.from_words(words, 3)
    k = len(planner.LINK_SIZES)
    assert fig.link_us == tuple(words[:k])
    assert fig.encode_us["bf16"] == tuple(words[k:k + 6:2])
    assert fig.decode_us["bf16"] == tuple(words[k + 1:k + 6:2])
    assert fig.encode_us["rqsgd4"] == tuple(words[-6::2])
    assert fig.words() == words  # and back, as the benchmarks record them
    assert fig.decode_us["rqsgd4"] == tuple(words[-5::2])


# -- low rank ---------------------------------------------------------------------------

def all_figures(link_gbps, ns_per_element=2.0, num_workers=4, rotation=1.0):
    """``figures`` with the low-rank candidates timed too: ``ns_per_element`` times the
    rank over 2 (their matrix products grow with it)."""
    fig = figures(num_workers=num_workers, link_gbps=link_gbps, latency_ms=1e-3,
                  ns_per_element=ns_per_element, rotation=rotation)
    encode, decode = dict(fig.encode_us), dict(fig.decode_us)
    for c in planner.LOW_RANK:
        encode[c.label] = decode[c.label] = tuple(
            int(50 + ns_per_element * c.rank / 2 * size / 1e3) for size in planner.CPU_SIZES)
    return planner.Figures(num_workers, fig.link_us, encode, decode, link_gbps, 1e-3)


def spectrum_errors(values):
    """``low_rank_errors``' figures for a matrix with these singular values."""
    captured = np.cumsum(np.asarray(values, np.float64) ** 2)
    total = float(captured[-1])
    return total, {r: max(0.0, 1.0 - captured[min(r, len(values)) - 1] / total)
                   for r in planner.RANKS}


@pytest.mark.parametrize("shape", [(40, 30), (200, 90), (1500, 700)])
def test_low_rank_errors_are_those_of_the_singular_values(shape):
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.normal(size=(shape[0], min(shape))))
    v, _ = np.linalg.qr(rng.normal(size=(shape[1], min(shape))))
    values = 0.7 ** np.arange(min(shape))  # a decaying spectrum, as gradients have
    matrix = (u * values) @ v.T
    sq, rel = planner.low_rank_errors(matrix.astype(np.float32))
    want_sq, want = spectrum_errors(values)
    assert sq == pytest.approx(want_sq, rel=1e-5)
    for r in planner.RANKS:
        # The randomized range finder of the large one can only miss energy: never below.
        assert rel[r] >= want[r] - 1e-6
        assert rel[r] == pytest.approx(want[r], rel=1e-3, abs=1e-6)
    # A rank-1 matrix loses nothing at any rank; zeros have nothing to lose.
    _, rel = planner.low_rank_errors(np.outer(np.arange(1.0, 61), np.ones(50)))
    assert max(rel.values()) < 1e-9
    assert planner.low_rank_errors(np.zeros((30, 30)))[1] == {r: 0.0 for r in planner.RANKS}
    spoiled = np.ones((30, 30))
    spoiled[3, 4] = np.inf
    assert planner.low_rank_errors(spoiled)[1] == {}  # a step that was not finite


def test_a_sparse_tables_errors_are_those_of_its_touched_rows():
    # An embedding table densified from a step's rows: 4096 x 64 with 150 rows touched.
    # Its errors are its touched block's exact ones (the zeros change no singular
    # value), not the randomized finder's bound; top-k ranks the touched entries only,
    # with k from the whole table.
    rng = np.random.default_rng(5)
    table = np.zeros((4096, 64), np.float32)
    rows = rng.choice(4096, 150, replace=False)
    block = rng.standard_t(3, size=(150, 64)).astype(np.float32)
    table[rows] = block
    table[:, 7] = 0.0  # a column no row reaches
    values = np.linalg.svd(table[rows].astype(np.float64), compute_uv=False)
    sq, rel = planner.low_rank_errors(table)
    want_sq, want = spectrum_errors(values)
    assert sq == pytest.approx(want_sq, rel=1e-9)
    for r in planner.RANKS:
        assert rel[r] == pytest.approx(want[r], rel=1e-9, abs=1e-12)
    squares = np.sort(np.square(table.astype(np.float64).ravel()))[::-1]
    k = math.ceil(0.01 * table.size)  # 2622 of the 9450 touched entries
    _, kept = planner.top_k_errors(table, (0.01, 0.05))
    assert kept[0.01] == pytest.approx(1.0 - squares[:k].sum() / squares.sum(), rel=1e-9)
    assert kept[0.05] == 0.0  # k = 13,108: every touched entry


# The measured matrices of ``GRADIENTS``: ``fc1`` nearly rank 1, ``fc2`` a slow spectrum
# (rank 8 keeps 40 % of it), ``embed`` flat (what low rank cannot send); ``conv`` and
# ``head`` in between.
MEASURED = {
    "fc1": spectrum_errors([1.0] + [0.01] * 200),
    "fc2": spectrum_errors(0.97 ** np.arange(500)),
    "embed": spectrum_errors(np.ones(512)),
    "conv": spectrum_errors(0.8 ** np.arange(64)),
    "head": spectrum_errors(0.5 ** np.arange(10)),
}


def test_a_slow_link_sends_measured_matrices_low_rank_within_their_budget():
    low_rank = planner.LowRank(2, MEASURED)
    plan = planner.make_plan(GRADIENTS, all_figures(0.1), 0.05, low_rank=low_rank)
    labels = {e.name: e.label for e in plan.entries}
    shapes = {name: shape for name, shape, _ in GRADIENTS}
    budget = sum(MEASURED[name][0] * MEASURED[name][1][2] for name in MEASURED
                 if planner.BY_LABEL["psgd2"].compressor.supports(tf.TensorShape(shapes[name]),
                                                                  tf.float32))
    assert plan.low_rank_budget == pytest.approx(budget)
    used = sum(MEASURED[e.name][0] * e.error for e in plan.entries if e.candidate.rank)
    assert plan.low_rank_error == pytest.approx(used)
    assert used <= budget * (1 + 1e-9)
    assert plan.mean_error <= 0.05
    # The table says what share of the budget the plan uses, and what the figures are.
    assert f"of their budget {budget:.3g} ({used / budget:.0%}; squared norms" in plan.table()
    assert labels["fc1"] == "psgd1", plan.table()  # nearly rank 1: rank 1 loses 1e-4
    assert planner.BY_LABEL[labels["embed"]].rank is None, plan.table()  # flat: quantized
    # Low rank sends fewer bytes than any quantizer on this link, and takes less time.
    quantized = planner.make_plan(GRADIENTS, all_figures(0.1), 0.05)
    assert not any(e.candidate.rank for e in quantized.entries)
    assert sum(e.sent_bytes for e in plan.entries) < sum(e.sent_bytes for e in quantized.entries)
    assert predicted_seconds(plan) < predicted_seconds(quantized)
    # Every low-rank entry's error is its measurement at its rank.
    for e in plan.entries:
        if e.candidate.rank:
            assert e.error == MEASURED[e.name][1][e.candidate.rank]
            assert e.path == "low_rank"


def test_top_k_errors_are_the_energy_its_largest_entries_leave():
    rng = np.random.default_rng(3)
    gradient = (rng.standard_t(3, size=(300, 70))).astype(np.float32)  # heavy tails
    squares = np.sort(np.square(gradient.astype(np.float64).ravel()))[::-1]
    sq, rel = planner.top_k_errors(gradient, (0.01, 0.1, 1.0))
    assert sq == pytest.approx(squares.sum(), rel=1e-9)
    for ratio in (0.01, 0.1):
        k = math.ceil(ratio * squares.size)  # top-k's own k
        assert rel[ratio] == pytest.approx(1.0 - squares[:k].sum() / squares.sum(), rel=1e-9)
    assert rel[1.0] == pytest.approx(0.0, abs=1e-12)  # everything kept
    # 150 entries at 1 %: two kept (k rounds up), and a gradient whose energy sits in
    # two entries loses nothing.
    few = np.zeros(150)
    few[[7, 99]] = [3.0, -4.0]
    assert planner.top_k_errors(few)[1] == {planner.TOPK_RATIO: 0.0}
    assert planner.top_k_errors(np.zeros((30, 30)))[1] == {planner.TOPK_RATIO: 0.0}
    spoiled = np.ones((30, 30))
    spoiled[3, 4] = np.nan
    assert planner.top_k_errors(spoiled)[1] == {}  # a step that was not finite


def with_top_k(fig, ns_per_element=2.0):
    """``fig`` with top-k's codecs timed at ``ns_per_element`` plus 50 us."""
    us = tuple(int(50 + ns_per_element * size / 1e3) for size in planner.CPU_SIZES)
    return dataclasses.replace(fig, encode_us={**fig.encode_us, "topk1": us},
                               decode_us={**fig.decode_us, "topk1": us})


def test_a_gradient_whose_energy_few_entries_hold_goes_top_k_on_a_slow_link():
    # ``embed``: a flat spectrum (low rank cannot send it), but its largest 1 % of the
    # entries hold all but 1e-4 of it (a densified embedding table of few touched rows
    # is such a gradient); top-k loses 90 % of every other gradient.
    measured = {name: (sq, {**rel, "topk1": 0.9}) for name, (sq, rel) in MEASURED.items()}
    measured["embed"] = (MEASURED["embed"][0], {**MEASURED["embed"][1], "topk1": 1e-4})
    low_rank = planner.LowRank(2, measured)
    fig = with_top_k(all_figures(0.1))
    plan = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank)
    entry = {e.name: e for e in plan.entries}["embed"]
    assert entry.label == "topk1" and entry.path == "allgather", plan.table()
    assert entry.error == 1e-4
    compressor = planner.BY_LABEL["topk1"].compressor
    assert entry.sent_bytes == tfgc.distribute.paths.auto.sent_bytes(
        "allgather", compressor, [(tf.TensorShape(entry.shape), tf.float32)], 4)
    # Its error counts in the measured budget, as the low-rank ones' does, and not in
    # the quantizers' mean.
    used = sum(measured[e.name][0] * e.error for e in plan.entries
               if e.candidate.error_key is not None)
    assert plan.low_rank_error == pytest.approx(used)
    assert used <= plan.low_rank_budget * (1 + 1e-9)
    assert plan.mean_error <= 0.05
    # Faster than the plan without top-k (the same figures but its timings).
    without = planner.make_plan(GRADIENTS, all_figures(0.1), 0.05, low_rank=low_rank)
    assert "topk1" not in {e.label for e in without.entries}
    assert plan.step_seconds() < without.step_seconds()
    # In a critical regime it is sent less compressed: never top-k.
    critical = planner.make_plan(GRADIENTS, fig, 0.05, critical={"embed"}, low_rank=low_rank)
    assert {e.name: e.label for e in critical.entries}["embed"] != "topk1"
    # Unmeasured (errors from before top-k was measured), it is not a candidate.
    older = planner.LowRank(2, MEASURED)
    assert "topk1" not in {e.label for e in planner.make_plan(
        GRADIENTS, fig, 0.05, low_rank=older).entries}


def test_a_held_gradient_goes_no_lossier_than_the_plan_that_ran():
    # After a learning-rate decay every gradient is critical and held at the label it
    # went as: a quantizer within that one's bound, low rank only where it went low
    # rank, at that rank or more, top-k only where it went top-k.
    low_rank = planner.LowRank(2, MEASURED)
    fig = all_figures(0.01)
    names = {name for name, _, _ in GRADIENTS}
    critical = planner.make_plan(GRADIENTS, fig, 0.05, critical=names, low_rank=low_rank)
    went = {e.name: e.label for e in critical.entries}
    four = [name for name, label in went.items() if label == "psgd4"]
    assert four  # the slow link took rank 4, the critical rank, somewhere
    # Held at what ran: the same plan.
    same = planner.make_plan(GRADIENTS, fig, 0.05, critical=names, low_rank=low_rank,
                             held=went)
    assert same.key() == critical.key()
    # Held where everything went float32: float32 again, on this slow link too.
    dense = planner.make_plan(GRADIENTS, fig, 0.05, critical=names, low_rank=low_rank,
                              held={name: "fp32" for name in names})
    assert {e.label for e in dense.entries} == {"fp32"}
    # Held at bf16: nothing lossier than bf16, and no low rank.
    bf16 = planner.make_plan(GRADIENTS, fig, 0.05, critical=names, low_rank=low_rank,
                             held={name: "bf16" for name in names})
    assert {e.label for e in bf16.entries} <= {"fp32", "bf16"}
    # Held at rank 8 where rank 4 would be taken: rank 8 there or no low rank.
    eight = planner.make_plan(GRADIENTS, fig, 0.05, critical=names, low_rank=low_rank,
                              held=dict(went, **{four[0]: "psgd8"}))
    assert {e.name: e.label for e in eight.entries}[four[0]] in ("psgd8", "bf16", "fp32")
    # A running plan below its held rank is ruled out (``only``); at it, priced.
    assert planner.make_plan(GRADIENTS, fig, 0.05, critical=names, low_rank=low_rank,
                             only=went, held=dict(went, **{four[0]: "psgd8"})) is None
    assert planner.make_plan(GRADIENTS, fig, 0.05, critical=names, low_rank=low_rank,
                             only=went, held=went) is not None
    # A label the planner does not know holds the gradient to quantizers of the
    # critical bound (as a record from another version might name).
    other = planner.make_plan(GRADIENTS, fig, 0.05, critical=names, low_rank=low_rank,
                              held={four[0]: "psgd99"})
    assert {e.name: e.label for e in other.entries}[four[0]] in ("bf16", "fp32")
    no_lossier = planner._no_lossier  # pylint: disable=protected-access
    label = planner.BY_LABEL
    assert no_lossier(label["topk1"], label["topk1"])
    assert no_lossier(label["psgd4"], label["psgd8"])
    assert not no_lossier(label["psgd4"], label["psgd2"])
    assert not no_lossier(label["psgd4"], label["topk1"])
    assert not no_lossier(label["topk1"], label["psgd8"])
    assert not no_lossier(label["bf16"], label["psgd8"]) and not no_lossier(None, label["psgd8"])


@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_the_low_rank_budget_holds_at_every_default_rank(rank):
    low_rank = planner.LowRank(rank, MEASURED)
    for rate in (0.01, 0.1, 1.0):
        plan = planner.make_plan(GRADIENTS, all_figures(rate), 0.05, low_rank=low_rank)
        assert plan.low_rank_error <= plan.low_rank_budget * (1 + 1e-9)
        assert plan.mean_error <= 0.05 + 1e-12


def test_a_given_choice_is_priced_as_the_planner_prices_it_or_ruled_out():
    low_rank = planner.LowRank(2, MEASURED)
    fig = all_figures(0.1)
    plan = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank)
    labels = {e.name: e.label for e in plan.entries}
    again = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, only=labels)
    assert again.key() == plan.key()
    assert again.step_seconds() == pytest.approx(plan.step_seconds())
    # Under a slower CPU the same choice costs more, and its error is unchanged.
    slower = planner.make_plan(GRADIENTS, all_figures(0.1, ns_per_element=8.0), 0.05,
                               low_rank=low_rank, only=labels)
    assert slower.key() == plan.key() and slower.step_seconds() > plan.step_seconds()
    assert slower.low_rank_error == pytest.approx(plan.low_rank_error)
    # All float32: allowed, and slower on this link than the plan.
    dense = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank,
                              only={name: "fp32" for name, _, _ in GRADIENTS})
    assert {e.label for e in dense.entries} == {"fp32"}
    assert dense.step_seconds() > plan.step_seconds()
    # Ruled out: a rank below the critical rank on a critical gradient, a low-rank error
    # past the budget (rank 1 on the flat embedding), a quantizer past the error budget,
    # a candidate the gradient cannot take.
    low = dict(labels, fc1="psgd1")
    assert planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, only=low,
                             critical={"fc1"}) is None
    assert planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank,
                             only=dict(labels, embed="psgd1")) is None
    coarse = {name: "rqsgd4" for name, _, _ in GRADIENTS}
    assert planner.make_plan(GRADIENTS, fig, 1e-6, only=coarse) is None
    assert planner.make_plan(GRADIENTS, fig, 0.05, only=dict(labels, head="psgd8")) is None


def test_a_pinned_choice_is_taken_whatever_the_budgets_and_regimes_say():
    low_rank = planner.LowRank(2, MEASURED)
    fig = all_figures(0.1)
    names = [name for name, _, _ in GRADIENTS]
    # Past every budget, critical, low rank without a measurement: as pinned, each
    # entry saying so; the same choice unforced is ruled out.
    coarse = {name: "rqsgd4" for name in names}
    assert planner.make_plan(GRADIENTS, fig, 1e-6, only=coarse) is None
    pinned = planner.make_plan(GRADIENTS, fig, 1e-6, only=coarse, critical=set(names),
                               forced=True)
    assert [e.label for e in pinned.entries] == ["rqsgd4"] * len(names)
    assert {e.reason for e in pinned.entries} == {"pinned"}
    assert pinned.mean_error > 1e-6  # what it uses, past the budget
    # Priced as the planner prices the same choice where it is allowed.
    free = planner.make_plan(GRADIENTS, fig, 0.5, only=coarse)
    assert pinned.step_seconds() == pytest.approx(free.step_seconds())
    ranked = planner.make_plan(GRADIENTS, fig, 0.05, only={n: "psgd1" for n in names},
                               low_rank=planner.LowRank(2, {}), forced=True)
    assert {e.label for e in ranked.entries} == {"psgd1"}
    assert all(math.isnan(e.error) for e in ranked.entries)  # nothing measured
    assert ranked.low_rank_error == 0.0
    # With measured errors, the pinned low rank counts what it uses of the budget,
    # beyond it too.
    measured = planner.make_plan(GRADIENTS, fig, 0.05, only={n: "psgd1" for n in names},
                                 low_rank=low_rank, forced=True)
    assert measured.low_rank_error > measured.low_rank_budget > 0
    # A gradient the label does not take goes as float32, saying why; the others as
    # pinned.
    vector = GRADIENTS + [("bias", (512,), "float32")]
    mixed = planner.make_plan(vector, fig, 0.05, only={n: "psgd2" for n in names + ["bias"]},
                              forced=True)
    assert [e.label for e in mixed.entries] == ["psgd2"] * len(names) + ["fp32"]
    assert mixed.entries[-1].reason == "pinned as psgd2, which does not take this gradient"
    # Measured on one gradient alone: its error and share of the budget counted,
    # the others' errors unknown (NaN) and left out of every sum.
    one = planner.LowRank(2, {"fc1": MEASURED["fc1"]})
    partial = planner.make_plan(GRADIENTS, fig, 0.05, only={n: "psgd1" for n in names},
                                low_rank=one, forced=True)
    errors = {e.name: e.error for e in partial.entries}
    assert math.isfinite(errors.pop("fc1")) and all(math.isnan(v) for v in errors.values())
    assert 0 < partial.low_rank_error < math.inf and partial.mean_error == 0.0
    # Figures without the measured candidates' timings cannot price them.
    assert planner.make_plan(GRADIENTS, figures(link_gbps=0.1), 0.05,
                             only={n: "psgd2" for n in names}, forced=True) is None
    with pytest.raises(ValueError, match="`only`"):
        planner.make_plan(GRADIENTS, fig, 0.05, forced=True)


def test_a_pinned_plan_holds_until_given_back():
    # One worker in this process: the planner plans its gradients as on a cluster.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    cdo = strategy.cross_device_ops
    with pytest.raises(ValueError, match="needs a planned step first"):
        cdo.pin_plan({"a/kernel:0": "bf16"})
    assert cdo.pin_plan("bf16") is False  # before the first step: it plans as pinned
    model = small_model(strategy)
    x, y = small_data(16)
    model.fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
    plan = strategy.compression_plan()
    assert [(e.name, e.label, e.reason) for e in plan.entries] == \
        [("a/kernel:0", "bf16", "pinned")]
    assert cdo.pin_plan("bf16") is False  # the same plan: no retrace
    # Intervals price the pinned plan anew but keep it.
    cdo.track_regimes()
    model.fit(x, y, batch_size=4, steps_per_epoch=2, verbose=0)
    cdo.adapt(0.5, step_s=0.01)
    model.fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
    assert [e.label for e in strategy.compression_plan().entries] == ["bf16"]
    # Low rank, its timings measured first; the model still trains under it.
    generation = cdo.generation
    assert cdo.pin_plan({"a/kernel:0": "psgd2"}) is True
    assert cdo.generation == generation + 1
    before = model.get_weights()
    history = model.fit(x, y, batch_size=4, steps_per_epoch=2, verbose=0)
    assert [e.label for e in strategy.compression_plan().entries] == ["psgd2"]
    assert "psgd2" in strategy.compression_plan().figures.encode_us
    assert np.isfinite(history.history["loss"]).all()
    assert not np.array_equal(before[0], model.get_weights()[0])
    # Bad choices fail naming the argument and leave the pin as it was.
    generation = cdo.generation
    for bad, match in [("bf17", "is not a candidate"), ({"a/kernel:0": "int3"}, "not candidates"),
                       ({"a/kernel:0": ["bf16"]}, "not candidates"),
                       ({3: "bf16"}, "keys must be gradient names"),
                       ({"nope": "bf16"}, "no plan has"), ({}, "non-empty dict"),
                       (8, "`choice` must be")]:
        with pytest.raises(ValueError, match=match):
            cdo.pin_plan(bad)
    model.fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
    assert cdo.generation == generation  # no retrace: still pinned as before
    assert [e.label for e in strategy.compression_plan().entries] == ["psgd2"]
    # A checkpoint keeps what the pinned steps measured, not the pin: restored, the
    # planner plans afresh from the restored figures (nothing measured again).
    record = cdo._auto.snapshot()  # pylint: disable=protected-access
    assert [part["pinned"] for part in record["layouts"]] == [True]
    again = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    again.cross_device_ops._auto.restored(json.loads(json.dumps(record)))  # pylint: disable=protected-access
    small_model(again).fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
    assert [(e.label, e.reason) for e in again.compression_plan().entries] == \
        [("fp32", "float32 is the fastest on this link")]
    assert again.cross_device_ops._auto.measurements == 0  # pylint: disable=protected-access
    # Given back: the planner's own choice again (one worker: nothing to send, float32).
    assert cdo.pin_plan(None) is True
    model.fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
    own = strategy.compression_plan()
    assert [e.label for e in own.entries] == ["fp32"] and own.entries[0].reason != "pinned"
    # Nothing pinned: None leaves the planner's plan as it is (no new plan, no retrace).
    generation = cdo.generation
    assert cdo.pin_plan(None) is False and cdo.generation == generation
    assert strategy.compression_plan() is own


@pytest.mark.parametrize("pin, rows", [("rqsgd4", "rqsgd4"), ("bf16", "bf16"),
                                       ("fp32", "fp32"), ("psgd2", "fp32"),
                                       ("topk1", "fp32")])
def test_a_pinned_table_goes_as_rows_in_the_pinned_quantizer_or_float32(pin, rows):
    # The table planned alone on one worker: unpinned, its rows go float32 (nothing
    # travels); pinned, as the pin says where it is a quantizer; low rank and top-k
    # keep no residual or query for rows that change every step: float32.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    strategy.cross_device_ops.pin_plan(pin)
    history = fit_bag(strategy, 2)
    (plan,) = strategy.compression_plans()
    (table,) = plan.tables
    assert (table.label, table.dense) == (rows, False)
    assert np.all(np.isfinite(history.history["loss"]))


def test_a_low_rank_pin_before_the_first_step_measures_its_timings_then():
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    strategy.cross_device_ops.pin_plan("psgd1")
    model = small_model(strategy)
    history = model.fit(*small_data(8), batch_size=4, steps_per_epoch=2, verbose=0)
    plan = strategy.compression_plan()
    assert [(e.label, e.reason) for e in plan.entries] == [("psgd1", "pinned")]
    assert plan.entries[0].cpu_s > 0 and "psgd1" in plan.figures.encode_us
    assert np.isfinite(history.history["loss"]).all()


def test_a_new_plan_is_taken_when_it_saves_more_than_a_change_costs():
    low_rank = planner.LowRank(2, MEASURED)
    fig = all_figures(0.1)
    new = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank)
    kept = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank,
                             only={name: "bf16" for name, _, _ in GRADIENTS})
    gain = kept.step_seconds() - new.step_seconds()
    assert gain > 0
    assert planner.change_pays(kept, new, 0.0)
    # No slope measured (no pace at all here): the change must pay for its way back too.
    assert planner.UNMEASURED_CHANGES == 2
    assert planner.change_pays(kept, new, gain / 2 * 0.99)
    assert not planner.change_pays(kept, new, gain / 2 * 1.01)
    assert planner.change_pays(None, new, 1e9)  # the current plan is ruled out
    # Where steps measured the slope (here exactly, four plans on one line), the change
    # pays for itself alone.
    points = [(c, 0.040 + c, 1e-9) for c in (0.01, 0.02, 0.03, 0.04)]
    pace = planner.pace_from(points, 0.0)
    assert pace.measured_slope and pace.scale == pytest.approx(1.0)
    new, kept = (planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, pace=pace,
                                   only={e.name: e.label for e in plan.entries})
                 for plan in (new, kept))
    gain = planner.least_gain(kept, new)
    assert gain > 0
    assert planner.change_pays(kept, new, gain * 0.99)
    assert not planner.change_pays(kept, new, gain * 1.01)


def test_the_pace_is_the_line_through_the_steps_that_ran():
    # Two plans that ran: steps of 40 ms plus half the predicted communication.
    pace = planner.pace_from([(0.010, 0.045), (0.030, 0.055)], 0.3)
    assert (pace.compute_s, pace.scale, pace.low_rank_steps) == \
        (pytest.approx(0.040), pytest.approx(0.5), 0.3)
    assert pace.seconds(0.020, 0.5) == pytest.approx((0.040 + 0.010) * (1 + 0.3 * 0.5))
    # One plan: its prediction as it is, the rest of the step compute; a step shorter
    # than its prediction: communication alone, at the share measured.
    one = planner.pace_from([(0.010, 0.050)], 0.0)
    assert (one.compute_s, one.scale) == (pytest.approx(0.040), 1.0)
    short = planner.pace_from([(0.200, 0.050)], 0.0)
    assert (short.compute_s, short.scale) == (0.0, pytest.approx(0.25))
    # Predictions too close to tell apart (0.1 ms on 55 ms steps) count as one plan,
    # at the points' mean weighed by their errors (the drift's alone: a share of each).
    close = planner.pace_from([(0.0100, 0.050), (0.0101, 0.060)], 0.0)
    w = np.array([0.050, 0.060]) ** -2
    assert (close.compute_s, close.scale) == (
        pytest.approx(np.average([0.050, 0.060], weights=w)
                      - np.average([0.0100, 0.0101], weights=w)), 1.0)
    assert not close.measured_slope and not one.measured_slope
    # A slope past its bounds is held there; a line through negative compute goes
    # through the origin instead.
    steep = planner.pace_from([(0.010, 0.050), (0.030, 0.200)], 0.0)
    assert steep.scale == planner.PACE_SCALE[1]
    w = np.array([0.050, 0.200]) ** -2  # the drift's errors, a share of each step
    assert steep.compute_s == pytest.approx(np.average([0.050, 0.200], weights=w)
                                            - 2.0 * np.average([0.010, 0.030], weights=w))
    origin = planner.pace_from([(0.010, 0.010), (0.030, 0.050)], 0.0)
    w = np.array([0.010, 0.050]) ** -2
    centre = (w[0] * 0.0001 + w[1] * 0.0015) / (w[0] * 0.0001 + w[1] * 0.0009)
    assert (origin.compute_s, origin.scale) == (0.0, pytest.approx(centre))
    # Its interval is the slope's through the origin (errors: 10 % of each step, not
    # given, and the drift's 1 %), all of it communication.
    errors = np.array([0.010, 0.050]) * math.hypot(planner.PACE_PRIOR, planner.PACE_DRIFT)
    half = planner.PACE_Z / math.sqrt(np.sum(errors ** -2 * np.array([0.010, 0.030]) ** 2))
    assert [p.scale for p in origin.others] == pytest.approx(
        [max(centre - half, planner.PACE_SCALE[0]), min(centre + half, planner.PACE_SCALE[1])])
    assert all(p.compute_s == 0.0 for p in origin.others)
    assert origin.others[0].scale <= origin.scale <= origin.others[1].scale
    # Nothing timed (or nothing finite): no pace.
    assert planner.pace_from([], 0.3) is None
    assert planner.pace_from([(float("nan"), 0.05), (0.01, 0.0)], 0.3) is None


def test_the_pace_weighs_each_plan_by_its_error_and_bounds_its_slope():
    # Two plans, each step's error (2 and 1 ms) combined with the drift's (1 % of it).
    pace = planner.pace_from([(0.010, 0.045, 0.002), (0.030, 0.055, 0.001)], 0.3)
    errors = [math.hypot(0.002, planner.PACE_DRIFT * 0.045),
              math.hypot(0.001, planner.PACE_DRIFT * 0.055)]
    assert pace.scale == pytest.approx(0.5) and pace.compute_s == pytest.approx(0.040)
    half = planner.PACE_Z * math.hypot(*errors) / 0.020  # the slope's error, two points
    assert [p.scale for p in pace.others] == pytest.approx([0.5 - half, 0.5 + half])
    # Each end's line passes through the points' mean, weighed by the errors.
    w = np.array(errors) ** -2
    x, y = np.average([0.010, 0.030], weights=w), np.average([0.045, 0.055], weights=w)
    for other in pace.others + pace.near:
        assert other.compute_s + other.scale * x == pytest.approx(y)
        assert other.low_rank_steps == 0.3 and not other.others and not other.near
    # A trial's lines: at TRIAL_Z standard errors of the slope, not PACE_Z.
    near = half * planner.TRIAL_Z / planner.PACE_Z
    assert [p.scale for p in pace.near] == pytest.approx([0.5 - near, 0.5 + near])
    # A point without an error (none given, None, NaN) has PACE_PRIOR of its step; an
    # error of 0, the drift's alone.
    unknown = planner.pace_from([(0.010, 0.045, 0.1 * 0.045), (0.030, 0.055, 0.1 * 0.055)], 0.3)
    for points in ([(0.010, 0.045), (0.030, 0.055, None)],
                   [(0.010, 0.045, float("nan")), (0.030, 0.055)]):
        assert planner.pace_from(points, 0.3) == unknown
    exact = planner.pace_from([(0.010, 0.045, 0.0), (0.030, 0.055, 0.0)], 0.3)
    assert exact.others[1].scale - exact.others[0].scale == pytest.approx(
        2 * planner.PACE_Z * planner.PACE_DRIFT * math.hypot(0.045, 0.055) / 0.020)
    # Three plans on the line 40 ms + half the communication, and a fourth 10 ms off
    # it measured from two steps: its error keeps it from tilting the line, which the
    # same point, as precise as the others, tilts.
    line = [(c, 0.040 + 0.5 * c, 0.0002) for c in (0.010, 0.020, 0.030)]
    weighed = planner.pace_from(line + [(0.040, 0.070, 0.010)], 0.0)
    tilted = planner.pace_from(line + [(0.040, 0.070, 0.0002)], 0.0)
    assert abs(weighed.scale - 0.5) < 0.05 < abs(tilted.scale - 0.5)
    # Noise that takes an end past its bound: that end is held there.
    errors = [math.hypot(0.004, planner.PACE_DRIFT * t) for t in (0.045, 0.055)]
    half = planner.PACE_Z * math.hypot(*errors) / 0.020
    assert 0.5 - half < planner.PACE_SCALE[0] < 0.5 + half < planner.PACE_SCALE[1]
    low = planner.pace_from([(0.010, 0.045, 0.004), (0.030, 0.055, 0.004)], 0.3)
    assert low.measured_slope and low.scale == pytest.approx(0.5)
    assert [p.scale for p in low.others[:2]] == pytest.approx(
        [planner.PACE_SCALE[0], 0.5 + half])
    # Noise that takes both past theirs says nothing of the slope: the plans count as
    # one (the prediction as it is, at the points' weighted mean), and no slope is
    # measured, so a change is weighed as one the steps have not priced yet. (Held at
    # both bounds, a change that loses low rank had to pay as if communication cost
    # 0.05 of its prediction, and a plan 30 % faster was not taken.)
    wide = planner.pace_from([(0.010, 0.045, 0.02), (0.030, 0.055, 0.02)], 0.3)
    errors = [math.hypot(0.02, planner.PACE_DRIFT * t) for t in (0.045, 0.055)]
    assert 0.5 - planner.PACE_Z * math.hypot(*errors) / 0.020 < planner.PACE_SCALE[0]
    w = np.array(errors) ** -2
    x, y = np.average([0.010, 0.030], weights=w), np.average([0.045, 0.055], weights=w)
    assert not wide.measured_slope and wide.others == () == wide.near
    assert (wide.scale, wide.compute_s) == (1.0, pytest.approx(y - x))
    # Three plans that scatter about their line more than their errors say: the
    # interval widens by the square root of chi^2 over n - 2; on a line, it does not.
    comm = [0.010, 0.020, 0.030]
    for steps, widened in (([0.045, 0.060, 0.055], True), ([0.045, 0.050, 0.055], False)):
        pace = planner.pace_from([(c, t, 0.0002) for c, t in zip(comm, steps)], 0.0)
        e = np.array([math.hypot(0.0002, planner.PACE_DRIFT * t) for t in steps])
        w = e ** -2
        x, y = np.average(comm, weights=w), np.average(steps, weights=w)
        sxx = np.sum(w * (np.array(comm) - x) ** 2)
        b = np.sum(w * (np.array(comm) - x) * (np.array(steps) - y)) / sxx
        chi2 = np.sum(w * (np.array(steps) - y - b * (np.array(comm) - x)) ** 2)
        half = planner.PACE_Z / math.sqrt(sxx) * (math.sqrt(chi2) if widened else 1.0)
        assert bool(chi2 > 1) == widened
        assert [p.scale for p in pace.others[:2]] == pytest.approx(
            [max(b - half, planner.PACE_SCALE[0]), min(b + half, planner.PACE_SCALE[1])])


def test_a_change_is_weighed_at_the_bend_where_the_pace_has_no_compute_left():
    # Steps mostly communication, and noisy: the interval of slopes reaches past the
    # one at which the line through the points' mean has no compute left (y / x),
    # where a change's gain bends; that line is weighed too.
    pace = planner.pace_from([(0.040, 0.045, 0.01), (0.080, 0.055, 0.01)], 0.3)
    lo, hi, bend = pace.others
    errors = [math.hypot(0.01, planner.PACE_DRIFT * t) for t in (0.045, 0.055)]
    w = np.array(errors) ** -2
    x, y = np.average([0.040, 0.080], weights=w), np.average([0.045, 0.055], weights=w)
    assert lo.scale < y / x < hi.scale
    assert (bend.compute_s, bend.scale) == (0.0, pytest.approx(y / x))
    assert hi.compute_s == 0.0 and lo.compute_s == pytest.approx(y - lo.scale * x)
    # A narrow interval has no bend in it.
    assert len(planner.pace_from([(0.040, 0.045, 0.0001), (0.080, 0.055, 0.0001)],
                                 0.3).others) == 2


def test_a_pace_beside_other_sets_prices_their_communication_with_its_own():
    # A step that reduces two sets (a GAN's optimizers): the line through whole steps
    # against both sets' predicted communication, 12 ms of it the other set's. One
    # set's plan of c seconds then costs what the whole step of c + 12 ms does, along
    # the fitted line and each line of its interval (the bend's too).
    pace = planner.pace_from([(0.040, 0.045, 0.01), (0.080, 0.055, 0.01)], 0.3)
    beside = pace.beside(0.012)
    assert beside.shared_s == 0.012 and len(beside.others) == len(pace.others) == 3
    assert len(beside.near) == len(pace.near) >= 2
    for whole, part in zip((pace,) + pace.others + pace.near,
                           (beside,) + beside.others + beside.near):
        for comm, share in ((0.0, 0.0), (0.020, 0.5), (0.050, 1.0)):
            assert part.seconds(comm, share) == pytest.approx(whole.seconds(comm + 0.012, share))
        assert (part.scale, part.low_rank_steps) == (whole.scale, whole.low_rank_steps)
    assert pace.beside(0.0) is pace


def test_a_checkpoints_timed_steps_read_back_with_or_without_their_errors():
    from tfgc.distribute import autoplan
    rows = [["auto:a=bf16@allreduce", 0.02, 0.05, 0.001], ["auto:a=psgd8@low_rank", 0.01, 0.048]]
    rows.append(["auto:a=qsgd8@allgather", 0.015, 0.049, None])  # not given
    steps = autoplan.steps_from_record(json.loads(json.dumps(rows)))
    assert steps["auto:a=bf16@allreduce"] == (0.02, 0.05, 0.001)
    # Rows without an error (older records) or with None: unknown, NaN.
    for key in ("auto:a=psgd8@low_rank", "auto:a=qsgd8@allgather"):
        assert steps[key][:2] == tuple(rows[[r[0] for r in rows].index(key)][1:3])
        assert math.isnan(steps[key][2])


def test_a_change_must_pay_at_every_slope_the_steps_allow_or_lose_nothing_near_it():
    # The current plan sends low rank (fewer bytes, more steps); the other quantizes.
    # The steps say the link weighs less than predicted (a slope of 0.15): at that
    # slope the low-rank plan's extra steps cost more than its bytes save, but from
    # about 0.31 on they cost less.
    low_rank = planner.LowRank(2, MEASURED)
    fig = all_figures(1.0)
    labels = {}
    for name, plan in (("free", planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank)),
                       ("quantized", planner.make_plan(GRADIENTS, fig, 0.05))):
        labels[name] = {e.name: e.label for e in plan.entries}
    quantized = planner.make_plan(GRADIENTS, fig, 0.05, only=labels["quantized"])
    free = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, only=labels["free"])
    c_free, c_quantized = free.step_seconds(), quantized.step_seconds()
    compute, slope = 0.2, 0.15

    def priced(pace):
        return [planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank,
                                  only=labels[name], pace=pace)
                for name in ("free", "quantized")]

    # The crossing the comment above states: with this compute, the
    # quantized plan gains at a slope of 0.15 and 0.3, and loses at 0.35.
    for scale, sign in ((0.15, 1), (0.3, 1), (0.35, -1)):
        kept, new = priced(planner.Pace(compute, scale, 3.0))
        assert sign * (kept.paced_seconds() - new.paced_seconds()) > 0, scale
    # The low-rank plan ran long (its step known within 0.3 ms); the quantized one
    # ran a few steps, whose spread gives an error of 20 ms or 10 ms, or many (0.3 ms).
    found = {}
    for se in (0.020, 0.010, 0.0003):
        pace = planner.pace_from([(c_free, compute + slope * c_free, 0.0003),
                                  (c_quantized, compute + slope * c_quantized, se)], 3.0)
        assert pace.scale == pytest.approx(slope) and pace.measured_slope
        kept, new = priced(pace)
        fitted = kept.paced_seconds() - new.paced_seconds()
        # At the fitted slope the quantized plan is faster to the same accuracy.
        assert fitted > 0.002
        found[se] = (pace, kept, new, fitted)
    # 20 ms: the slopes within one standard error reach past the crossing (0.35):
    # the change may lose there, and is not taken, even for free.
    pace, kept, new, _ = found[0.020]
    assert max(p.scale for p in pace.near) > 0.35
    assert not planner.change_pays(kept, new, 0.0) and not planner.is_trial(kept, new, 0.0)
    # 10 ms: the interval's end (0.45) is past the crossing, but one standard error
    # (0.3) is not: a trial, which must save twice what a change costs at the fitted
    # slope, as one before a slope is measured.
    pace, kept, new, fitted = found[0.010]
    assert max(p.scale for p in pace.others) > 0.35 > 0.3 > max(p.scale for p in pace.near)
    assert planner.least_gain(kept, new) < 0 < planner.least_gain(kept, new, near=True)
    assert planner.is_trial(kept, new, 0.0)
    assert planner.change_pays(kept, new, fitted / planner.UNMEASURED_CHANGES * 0.99)
    assert not planner.change_pays(kept, new, fitted / planner.UNMEASURED_CHANGES * 1.01)
    # A wrong trial runs its steps at the interval's end: where they are half of those
    # the change pays over, it must save half what it would lose there as well.
    loss = -planner.least_gain(kept, new)
    assert planner.trial_gain(kept, new, 0.001, 0.5) == pytest.approx(
        planner.UNMEASURED_CHANGES * 0.001 + 0.5 * loss)
    assert fitted > 0.5 * loss
    paid = (fitted - 0.5 * loss) / planner.UNMEASURED_CHANGES
    assert planner.change_pays(kept, new, paid * 0.99, 0.5)
    assert not planner.change_pays(kept, new, paid * 1.01, 0.5)
    assert planner.change_pays(kept, new, paid * 1.01, 0.0)
    # Nothing lost anywhere in the interval: the trial's steps add nothing to pay.
    pace, kept_certain, new_certain, _ = found[0.0003]
    assert planner.trial_gain(kept_certain, new_certain, 0.001, 1.0) == pytest.approx(
        planner.UNMEASURED_CHANGES * 0.001)
    # Many steps pin the slope where the quantized plan stays faster: the change pays
    # for itself alone at every slope they allow.
    pace, kept, new, fitted = found[0.0003]
    least = planner.least_gain(kept, new)
    assert max(p.scale for p in pace.others) < 0.3 and 0 < least < fitted
    assert planner.change_pays(kept, new, least * 0.99)
    # Past that, as a trial, up to half the fitted gain.
    assert fitted / planner.UNMEASURED_CHANGES > least
    assert planner.change_pays(kept, new, fitted / planner.UNMEASURED_CHANGES * 0.99)
    assert not planner.change_pays(kept, new, fitted / planner.UNMEASURED_CHANGES * 1.01)


def test_a_trials_share_is_its_steps_over_those_a_change_pays_over():
    assert planner.trial_share_of(50, 1000) == pytest.approx(0.05)
    # The fit's last interval, or a fit of unknown length: the change pays over the
    # trial's own steps, all of them at stake.
    assert planner.trial_share_of(50, 20) == 1.0
    assert planner.trial_share_of(50, None) == planner.trial_share_of(50, float("nan")) == 1.0
    # Not priced.
    assert planner.trial_share_of(None, 1000) == planner.trial_share_of(0, 1000) == 0.0
    assert planner.trial_share_of(float("nan"), 1000) == 0.0


def test_the_planner_keeps_its_plan_unless_a_change_pays_at_every_slope_or_is_a_trial(caplog):
    # AutoPlanner._plan_again, as adapt and measure_low_rank call it, on a one-worker
    # strategy's planner given figures for 4 workers, measured errors and two plans'
    # steps on a slope of 0.3. The current plan is the planner's choice at the least
    # slope two noisy steps allow (0.05). No least gain is asked (min_gain_s 0), yet
    # the kept plan is priced too: where the new plan loses within one standard error
    # of the slope, the plan stays; where it loses only further out, it is a trial,
    # taken where it saves twice the gain asked at the fitted slope; steps that pin
    # the slope near 0.3 change it.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    ops = strategy.cross_device_ops
    auto = ops._auto  # pylint: disable=protected-access
    auto.track_regimes()
    fig = all_figures(1.0)
    gradients = tuple(GRADIENTS)
    low_rank = planner.LowRank(2, MEASURED)
    free = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank)
    quantized = planner.make_plan(GRADIENTS, fig, 0.05)
    compute, slope = 0.2, 0.3

    def steps(se):
        return {plan.key(): (plan.step_seconds(), compute + slope * plan.step_seconds(),
                             error) for plan, error in ((free, 0.0003), (quantized, se))}

    noisy = planner.pace_from(list(steps(0.010).values()), 0.3)
    least = min(noisy.others, key=lambda pace: pace.scale)
    assert least.scale == planner.PACE_SCALE[0]
    current = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, pace=least)
    outcomes = {}
    for se, min_gain_s in ((0.020, 0.0), (0.005, 0.0), (0.005, None), (0.0003, 0.0)):
        # pylint: disable=protected-access
        lay = auto._layout(gradients)
        lay.critical, auto._low_rank = frozenset(), dict(MEASURED)
        auto._figures = (ops.generation, fig)
        lay.plan = (ops.generation, current)
        lay.steps = steps(se)
        fresh = auto._planned(lay, fig)
        assert fresh.pace.measured_slope and fresh.pace.scale == pytest.approx(slope)
        assert fresh.key() != current.key()  # the planner alone would change
        kept = auto._as_running(lay, fig, current)
        fitted = kept.paced_seconds() - fresh.paced_seconds()
        near, least = (planner.least_gain(kept, fresh, near) for near in (True, False))
        assert fitted > 0
        if se == 0.005:
            assert least < 0 < near  # a trial
            if min_gain_s is None:  # more than half the fitted gain: not taken
                min_gain_s = fitted / planner.UNMEASURED_CHANGES * 1.01
        generation = ops.generation
        caplog.clear()
        caplog.set_level(logging.INFO, logger="absl")
        changed = auto._take({lay: auto._plan_again(lay, current, min_gain_s)}, fig)
        outcomes[se, min_gain_s == 0] = changed
        # A trial says so, with what it would save and lose.
        tried = [r.getMessage() for r in caplog.records if "tries a new plan" in r.getMessage()]
        assert len(tried) == int(changed and least < 0)
        if tried:
            assert f"lose {-least * 1e3:.3f} ms at the worst pace" in tried[0]
        assert (ops.generation == generation + 1) == changed
        assert auto.plan.key() == (fresh.key() if changed else current.key())
        if not changed:
            # The kept plan priced anew, under the pace the steps measured.
            assert auto.plan.pace == fresh.pace
    assert outcomes == {(0.020, True): False, (0.005, True): True, (0.005, False): False,
                        (0.0003, True): True}


def test_a_timed_plan_is_priced_from_its_own_step_moved_along_the_slope():
    # The plan's step ran at 60 ms when the step's communication was predicted at
    # 30 ms (its own and another set's); now it is predicted at step_seconds() plus
    # the other set's 12 ms. Its cost is that step moved by the slope over the
    # difference, weighed by the steps its low-rank error adds, and so is its error.
    low_rank = planner.LowRank(2, MEASURED)
    fig = all_figures(1.0)
    pace = planner.Pace(0.02, 0.8, 0.3).beside(0.012)
    plan = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, pace=pace)
    assert 0 < plan.low_rank_share <= 1
    weight = 1 + 0.3 * plan.low_rank_share
    seconds, error = planner.timed_seconds(plan, (0.030, 0.060, 0.002))
    assert seconds == pytest.approx((0.060 + 0.8 * (plan.step_seconds() + 0.012 - 0.030))
                                    * weight)
    assert error == pytest.approx(math.hypot(0.002, planner.PACE_DRIFT * 0.060) * weight)
    # An error not given: the prior share of the step.
    _, error = planner.timed_seconds(plan, (0.030, 0.060))
    assert error == pytest.approx(math.hypot(planner.PACE_PRIOR * 0.060,
                                             planner.PACE_DRIFT * 0.060) * weight)
    # Where the predictions agree with the step, it is the pace's own price.
    on_line = (0.012 + plan.step_seconds(),
               pace.compute_s - pace.shared_compute_s + 0.8 * (0.012 + plan.step_seconds()))
    assert planner.timed_seconds(plan, on_line)[0] == pytest.approx(plan.paced_seconds())


def _timed_pair(step_a, step_b, se=0.0005):
    """Two plans of GRADIENTS under one pace, a quantized one (``a``) and a low-rank
    one (``b``), each timed at the given step, for ``planner.prefer_timed``."""
    low_rank = planner.LowRank(2, MEASURED)
    fig = all_figures(1.0)
    pace = planner.Pace(0.05, 1.0, 0.3)
    a = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, pace=pace,
                          only={name: "bf16" for name, _, _ in GRADIENTS})
    b = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, pace=pace)
    assert a.key() != b.key()
    timed = {a.key(): (a, (a.step_seconds(), step_a, se)),
             b.key(): (b, (b.step_seconds(), step_b, se))}
    return a, b, timed


def test_a_plan_that_ran_slower_than_one_timed_before_gives_way_to_it():
    a, b, timed = _timed_pair(0.100, 0.200)
    cost_a = planner.timed_seconds(a, timed[a.key()][1])[0]
    cost_b = planner.timed_seconds(b, timed[b.key()][1])[0]
    assert cost_b - cost_a > 0.05
    # b runs now and is the planner's choice again: its own step says a is faster.
    assert planner.prefer_timed(b, b, timed) is a
    # ... unless the change must save more than that a step.
    assert planner.prefer_timed(b, b, timed, min_gain_s=cost_b - cost_a + 1e-6) is b
    assert planner.prefer_timed(b, b, timed, min_gain_s=cost_b - cost_a - 1e-6) is a
    # a runs: it stays, whatever the planner would choose from its line.
    assert planner.prefer_timed(b, a, timed) is a
    # Steps as noisy as their difference: no change on a lucky step.
    a, b, noisy = _timed_pair(0.100, 0.104, se=0.004)
    assert planner.prefer_timed(b, b, noisy) is b
    a, b, tight = _timed_pair(0.100, 0.104, se=0.0001)
    assert planner.prefer_timed(b, b, tight) is a


def test_an_untimed_plan_is_tried_only_where_it_is_predicted_to_beat_every_timed_one():
    a, b, timed = _timed_pair(0.100, 0.200)
    del timed[b.key()]  # b never ran
    assert b.paced_seconds() < planner.timed_seconds(a, timed[a.key()][1])[0] or \
        pytest.fail("the test needs b predicted below a's step")
    assert planner.prefer_timed(b, a, timed) is None  # predicted faster: tried
    # a ran faster than b's prediction: a stays.
    slow_b = dataclasses.replace(b, pace=planner.Pace(0.5, 1.0, 0.3))
    assert planner.prefer_timed(slow_b, a, timed) is a
    # The current plan ruled out (None): the timed a where it ran faster than b's
    # prediction, b where predicted faster than a ran.
    assert planner.prefer_timed(slow_b, None, timed) is a
    assert planner.prefer_timed(b, None, timed) is None
    # Nothing to weigh by steps: no pace, nothing timed, or the current plan not timed.
    assert planner.prefer_timed(dataclasses.replace(b, pace=None), a, timed) is None
    assert planner.prefer_timed(slow_b, None, {}) is None
    assert planner.prefer_timed(slow_b, a, {}) is None
    assert planner.prefer_timed(slow_b, b, timed) is None


def _tracking_planner(spec="auto"):
    """A one-worker strategy's cross-device ops and their ``AutoPlanner``, tracking
    regimes (as under ``AutoPlanCallback``), for tests that set its layouts by hand."""
    ops = tfgc.CompressedMultiWorkerMirroredStrategy(compressor=spec).cross_device_ops
    auto = ops._auto  # pylint: disable=protected-access
    auto.track_regimes()
    return ops, auto


def _timed_layout(ops, auto, fig, current, steps):
    """``auto``'s layout of GRADIENTS running ``current`` under ``fig``, nothing
    critical, MEASURED's low-rank errors, each plan of ``steps`` ((plan, its median
    step in seconds) pairs) timed alone at its predicted communication, within
    0.5 ms."""
    # pylint: disable=protected-access
    lay = auto._layout(tuple(GRADIENTS))
    lay.critical, auto._low_rank = frozenset(), dict(MEASURED)
    auto._figures = (ops.generation, fig)
    lay.plan = (ops.generation, current)
    lay.steps = {plan.key(): (plan.step_seconds(), step, 0.0005)
                 for plan, step in steps}
    lay.beside = {key: "" for key in lay.steps}  # timed alone (``_timed``)
    return lay


@pytest.mark.parametrize("spec, allowed", [
    ("auto", {"psgd4", "psgd8"}), ("auto:critical_rank=8", {"psgd8"}),
    ("auto:critical_rank=0", {"fp32", "bf16"}),
    # fc1 loses more than this at rank 8 (``critical_error``): none either.
    ("auto:critical_error=1e-9", {"fp32", "bf16"})])
def test_the_strategys_critical_rank_limits_its_critical_gradients(spec, allowed):
    # The setting reaches the plans the strategy makes: with every gradient critical
    # on a slow link, fc1 (which takes rank 1 otherwise) goes as the setting allows.
    ops, auto = _tracking_planner(spec)
    fig = all_figures(0.1)
    lay = _timed_layout(ops, auto, fig, planner.make_plan(GRADIENTS, fig, 0.05), [])
    labels = {e.name: e.label for e in auto._planned(lay, fig).entries}  # pylint: disable=protected-access
    assert labels["fc1"] == "psgd1"
    lay.critical = "all"
    plan = auto._planned(lay, fig)  # pylint: disable=protected-access
    labels = {e.name: e.label for e in plan.entries}
    assert labels["fc1"] in allowed, plan.table()
    assert all(not e.candidate.rank or e.label in allowed for e in plan.entries)


TWO_SETS = (GRADIENTS[:3], GRADIENTS[3:])


def _set_plans(fig, label=None):
    """A plan for each of TWO_SETS under ``fig``: ``label`` on every gradient, or the
    budget's choice (None)."""
    return [planner.make_plan(g, fig, 0.05,
                              only=None if label is None else {n: label for n, _, _ in g})
            for g in TWO_SETS]


@pytest.mark.parametrize("given", [False, True])
def test_the_planner_goes_back_to_a_plan_that_ran_faster_and_stays_there(given):
    # AutoPlanner._decide with the plans that ran kept (``_timed`` fills
    # ``steps``): the low-rank plan, the planner's choice, ran twice as long as the
    # quantized one timed before it. It goes back to the quantized plan, retracing
    # once, and keeps it at the next interval's end with the same steps; unless the
    # link was given, not measured: the steps ran on another network.
    spec = "auto:link_gbps=1" if given else "auto"
    ops, auto = _tracking_planner(spec)
    fig = all_figures(1.0)
    low_rank = planner.LowRank(2, MEASURED)
    free = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank)
    quantized = planner.make_plan(GRADIENTS, fig, 0.05)
    assert free.low_rank_share > 0 and quantized.low_rank_share == 0
    # pylint: disable=protected-access
    lay = _timed_layout(ops, auto, fig, free, [(quantized, 0.100), (free, 0.200)])
    generation = ops.generation
    if given:
        assert auto._plan_again(lay, free, 0.0).key() != quantized.key()
        return
    assert auto._take(auto._decide([lay]), fig)
    assert ops.generation == generation + 1
    assert auto.plan.key() == quantized.key() and auto.went_back == 1
    assert not auto._take(auto._decide([lay]), fig)
    assert auto.plan.key() == quantized.key() and ops.generation == generation + 1
    assert auto.went_back == 1
    # Steps read back from a checkpoint record are plans' keys and figures only: the
    # plans are made again from the keys, and weigh the same.
    record = json.loads(json.dumps(auto.snapshot()))
    again, again_auto = _tracking_planner(spec)
    back = again_auto._layout(tuple(GRADIENTS))
    again_auto._low_rank = dict(MEASURED)
    again_auto._figures = (again.generation, fig)
    back.plan = (again.generation, free)
    autoplan.AutoPlanner._take_part(back, record["layouts"][0])
    assert back.steps == lay.steps and back.beside == lay.beside
    assert again_auto._plan_again(back, free, 0.0).key() == quantized.key()
    # A record from before the plans beside were kept: not weighed by the steps.
    for row in record["layouts"][0]["steps"]:
        del row[4:]
    autoplan.AutoPlanner._take_part(back, record["layouts"][0])
    assert back.beside == {}
    assert again_auto._plan_again(back, free, 0.0).key() != quantized.key()
    # A pinned plan stays pinned, whatever the steps say.
    again_auto._pin, count = "psgd2", again_auto.went_back
    autoplan.AutoPlanner._take_part(back, auto.snapshot()["layouts"][0])
    pinned = again_auto._decide([back])[back]
    assert {e.label for e in pinned.entries} == {"psgd2"} and again_auto.went_back == count


@pytest.mark.parametrize("same_beside", [False, True])
def test_a_set_weighs_only_the_steps_timed_beside_the_other_sets_plans_of_now(
        same_beside, monkeypatch):
    # Two sets a step (a GAN's): each timed step holds both sets' runs. The first set's
    # bf16 plan ran 105 ms beside the other set's old plan, its current plan 120 ms
    # beside the other's new one: the 15 ms may be the other set's change, not its own,
    # so the first set goes back to bf16 only where both were timed beside the same.
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    low_rank = planner.LowRank(2, MEASURED)
    first = TWO_SETS[0]
    # pylint: disable=protected-access
    lay = auto._layout(tuple(first))
    lay.critical, auto._low_rank = frozenset(), dict(MEASURED)
    auto._figures = (ops.generation, fig)
    partner = auto._layout(tuple(TWO_SETS[1]))  # the other set, and its plan now
    partner.plan = (ops.generation, planner.make_plan(TWO_SETS[1], fig, 0.05))
    beside = partner.plan[1].key()
    old = planner.make_plan(first, fig, 0.05, only={n: "bf16" for n, _, _ in first})
    current = planner.make_plan(first, fig, 0.05, low_rank=low_rank)
    lay.plan = (ops.generation, current)
    lay.others_s = 0.010
    lay.steps = {old.key(): (old.step_seconds() + 0.010, 0.105, 0.0005),
                 current.key(): (current.step_seconds() + 0.010, 0.120, 0.0005)}
    lay.beside = {old.key(): beside if same_beside else "auto:conv=bf16@allreduce",
                  current.key(): beside}
    timed = auto._timed_plans(lay, fig, current)
    assert set(timed) == ({old.key(), current.key()} if same_beside else {current.key()})
    if same_beside:
        # What is counted is the step's final choice: where the sets' plans weighed
        # together keep the current ones, the set's own going back is not.
        with monkeypatch.context() as patch:
            patch.setattr(autoplan.AutoPlanner, "_joint_back",
                          lambda self, ran, plans, gain: {o: o.plan[1] for o in ran})
            assert auto._plan_again(lay, current, 0.0).key() == old.key()
            assert auto._decide([lay, partner])[lay].key() == current.key()
            assert auto.went_back == 0
    taken = auto._decide([lay, partner])[lay]
    assert (taken.key() == old.key()) == same_beside
    assert auto.went_back == int(same_beside)
    # The other set has changed plan since the current one was timed: nothing timed
    # beside its plan of now, so the line alone weighs.
    partner.plan = (ops.generation, planner.make_plan(
        TWO_SETS[1], fig, 0.05, only={n: "fp32" for n, _, _ in TWO_SETS[1]}))
    assert partner.plan[1].key() != beside
    assert auto._timed_plans(lay, fig, current) == {}


def test_each_sets_timed_step_holds_both_plans_and_names_the_other_beside_it():
    # AutoPlanner._timed on two layouts that ran in the same steps (a GAN's): each
    # keeps the whole step against both plans' predicted communication, and the other
    # layout's plan key as what it ran beside; a layout alone would keep "".
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    # pylint: disable=protected-access
    a, b = auto._layout(tuple(TWO_SETS[0])), auto._layout(tuple(TWO_SETS[1]))
    auto._figures = (ops.generation, fig)
    plans = {a: planner.make_plan(TWO_SETS[0], fig, 0.05),
             b: planner.make_plan(TWO_SETS[1], fig, 0.05,
                                  only={n: "bf16" for n, _, _ in TWO_SETS[1]})}
    for lay, plan in plans.items():
        lay.plan = (ops.generation, plan)
    auto._timed([a, b], 0.120, 0.002)
    total = plans[a].step_seconds() + plans[b].step_seconds()
    for lay, other in ((a, b), (b, a)):
        key = plans[lay].key()
        assert lay.steps[key] == pytest.approx((total, 0.120, 0.002))
        assert lay.beside[key] == plans[other].key() == auto._beside(lay)
        assert lay.others_s == pytest.approx(plans[other].step_seconds())
    # What a checkpoint keeps of it: the fifth element of each row, which older code
    # reading the record leaves aside.
    row = auto.snapshot()["layouts"][0]["steps"][0]
    assert row[4] == plans[b].key()
    assert autoplan.steps_from_record([row]) == {row[0]: (row[1], row[2], row[3])}


def test_a_joint_weighs_the_plans_of_a_step_as_one():
    fig = all_figures(1.0)
    low_rank = planner.LowRank(2, MEASURED)
    a = planner.make_plan(TWO_SETS[0], fig, 0.05, low_rank=low_rank)
    b = planner.make_plan(TWO_SETS[1], fig, 0.05, low_rank=low_rank,
                          only={n: "psgd2" for n, _, _ in TWO_SETS[1]})
    assert a.low_rank_share > 0 and b.low_rank_share > 0
    pace = planner.Pace(0.02, 0.8, 0.3)
    joint = planner.Joint((a, b), pace)
    assert joint.key() == a.key() + "\n" + b.key()
    assert joint.step_seconds() == pytest.approx(a.step_seconds() + b.step_seconds())
    share = max(a.low_rank_share, b.low_rank_share)
    assert joint.low_rank_share == pytest.approx(share) and a.low_rank_share != share
    comm = a.step_seconds() + b.step_seconds()
    assert joint.paced_seconds() == pytest.approx((0.02 + 0.8 * comm) * (1 + 0.3 * share))
    assert planner.Joint((a, b)).paced_seconds() == pytest.approx(comm)
    # Timed, it is moved along the line as one plan.
    step, se = planner.timed_seconds(joint, (comm - 0.010, 0.150, 0.001))
    assert step == pytest.approx((0.150 + 0.8 * 0.010) * (1 + 0.3 * joint.low_rank_share))


def _two_sets_timed(auto, ops, fig, runs):
    """``auto``'s two layouts (GRADIENTS' first three, and the rest), nothing critical,
    each pair of plans of ``runs`` ((first set's plan, second's, median step) triples)
    run and timed together in turn (``_timed``), the last pair current."""
    # pylint: disable=protected-access
    layouts = [auto._layout(tuple(g)) for g in TWO_SETS]
    auto._figures = (ops.generation, fig)
    for lay in layouts:
        lay.critical = frozenset()
    for first, second, step in runs:
        for lay, plan in zip(layouts, (first, second)):
            lay.plan = (ops.generation, plan)
        auto._timed(layouts, step, 0.0005)
    return layouts


def test_two_sets_go_back_together_to_the_plans_that_ran_faster_together():
    # A GAN's two sets leave their critical regimes at the same interval's end, so both
    # change plan at once (float32 to the budget's), and the step runs slower (160 against
    # 100 ms). Neither set's own steps compare its plans beside the same plan of the
    # other (its earlier step ran beside the other's earlier plan), so each alone keeps
    # its plan; the plans that ran together compare, and both go back at once,
    # retracing once, then stay there; from a checkpoint's record too.
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    sets = TWO_SETS
    old, new = _set_plans(fig, "fp32"), _set_plans(fig)
    assert all(o.key() != n.key() for o, n in zip(old, new))
    # pylint: disable=protected-access
    layouts = _two_sets_timed(auto, ops, fig, [(*old, 0.100), (*new, 0.160)])
    for lay, plan in zip(layouts, new):
        assert auto._planned(lay, fig).key() == plan.key()  # the planner's choice
        assert set(auto._timed_plans(lay, fig, plan)) == {plan.key()}
        assert auto._plan_again(lay, plan).key() == plan.key()
    generation = ops.generation
    assert auto._take(auto._decide(layouts), fig)
    assert ops.generation == generation + 1 and auto.went_back == 1
    assert [lay.plan[1].key() for lay in layouts] == [p.key() for p in old]
    assert not auto._take(auto._decide(layouts), fig)
    assert [lay.plan[1].key() for lay in layouts] == [p.key() for p in old]
    assert auto.went_back == 1
    # Read back from a checkpoint record, where the new plans were current.
    for lay, plan in zip(layouts, new):
        lay.plan = (ops.generation, plan)
    record = json.loads(json.dumps(auto.snapshot()))
    again, again_auto = _tracking_planner()
    back = [again_auto._layout(tuple(g)) for g in sets]
    again_auto._figures = (again.generation, fig)
    for lay, plan, part in zip(back, new, record["layouts"]):
        lay.plan = (again.generation, plan)
        autoplan.AutoPlanner._take_part(lay, part)
    assert [p.key() for p in again_auto._decide(back).values()] == [p.key() for p in old]
    # On a given link, or under a pin, the steps do not choose.
    given, given_auto = _tracking_planner("auto:link_gbps=1")
    lays = _two_sets_timed(given_auto, given, fig, [(*old, 0.100), (*new, 0.160)])
    assert [p.key() for p in given_auto._decide(lays).values()] == [p.key() for p in new]


def test_a_sets_line_is_drawn_through_every_step_it_ran_in():
    # The second set kept its plan while the first changed: the second set's key holds
    # only the last of the two steps, the first's keys hold both, and the second set's
    # line goes through both (its pace measures a slope it could not alone).
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    sets = TWO_SETS
    first = [planner.make_plan(sets[0], fig, 0.05, only={n: label for n, _, _ in sets[0]})
             for label in ("fp32", "bf16")]
    second = planner.make_plan(sets[1], fig, 0.05)
    # pylint: disable=protected-access
    layouts = _two_sets_timed(auto, ops, fig, [(first[0], second, 0.150),
                                               (first[1], second, 0.110)])
    assert len(layouts[0].steps) == 2 and len(layouts[1].steps) == 1
    for lay in layouts:
        assert sorted(p[1] for p in auto._points(lay)) == [0.110, 0.150]
    assert auto._planned(layouts[1], fig).pace.measured_slope
    # A step of the first set timed beside another plan of the second is not one the
    # second set ran in (that plan's own step forgotten).
    layouts[0].beside[first[0].key()] = "auto:conv=fp32@allreduce;head=fp32@allreduce"
    assert [p[1] for p in auto._points(layouts[1])] == [0.110]
    assert not auto._planned(layouts[1], fig).pace.measured_slope


def test_a_step_another_set_did_not_run_in_is_not_one_of_its_steps():
    # Two sets planned in one generation, trained in turn (models fitted one after
    # the other): each step timed names no plan beside it, and neither set's line nor
    # the sets timed together hold the other's steps. Restored rows whose error is
    # unknown (None, NaN once read) are still one step each, whichever set keeps them.
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    sets = TWO_SETS
    plans = _set_plans(fig)
    # pylint: disable=protected-access
    layouts = [auto._layout(tuple(g)) for g in sets]
    auto._figures = (ops.generation, fig)
    for lay, plan in zip(layouts, plans):
        lay.critical, lay.plan = frozenset(), (ops.generation, plan)
    auto._timed([layouts[0]], 0.100, 0.001)
    auto._timed([layouts[1]], 0.030, 0.001)
    assert [lay.beside for lay in layouts] == [{plans[0].key(): ""}, {plans[1].key(): ""}]
    assert [p[1] for p in auto._points(layouts[0])] == [0.100]
    assert [p[1] for p in auto._points(layouts[1])] == [0.030]
    assert auto._timed_together(layouts, fig) == ({}, [])
    # Both ran, twice (the first set's plan changed): restored with unknown errors,
    # the step both sets keep is one point.
    other = planner.make_plan(sets[0], fig, 0.05, only={n: "bf16" for n, _, _ in sets[0]})
    auto._timed(layouts, 0.150, 0.001)
    layouts[0].plan = (ops.generation, other)
    auto._timed(layouts, 0.110, 0.001)
    record = json.loads(json.dumps(auto.snapshot()))
    again, again_auto = _tracking_planner()
    back = [again_auto._layout(tuple(g)) for g in sets]
    for lay, part in zip(back, record["layouts"]):
        for row in part["steps"]:
            row[3] = None
        autoplan.AutoPlanner._take_part(lay, part)
    # (Each plan's key keeps its last step: the solo steps are overwritten.)
    for lay in back:
        assert sorted(p[1] for p in again_auto._points(lay)) == [0.110, 0.150]


def test_plans_ran_together_are_matched_by_set_and_left_out_where_ruled_out():
    # AutoPlanner._timed_together: the pairs of plans timed together, whichever
    # layout's steps name them; a pair timed beside a third layout's plan is left out,
    # and so is a pair with a plan the regimes now rule out (its step still draws the
    # line through whole steps).
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    sets = TWO_SETS
    bf16, new = _set_plans(fig, "bf16"), _set_plans(fig)
    # pylint: disable=protected-access
    layouts = _two_sets_timed(auto, ops, fig, [(bf16[0], new[1], 0.100),
                                               (new[0], new[1], 0.120)])
    together, points = auto._timed_together(layouts, fig)
    assert set(together) == {bf16[0].key() + "\n" + new[1].key(),
                             new[0].key() + "\n" + new[1].key()}
    assert sorted(p[1] for p in points) == [0.100, 0.120]
    # The first set's bf16 plan ran beside a third layout's plan too.
    first = layouts[0]
    first.beside[bf16[0].key()] += ";auto:other=fp32@allreduce"
    together, points = auto._timed_together(layouts, fig)
    assert set(together) == {new[0].key() + "\n" + new[1].key()}
    assert len(points) == 1
    # The first set in a critical regime: its budget plan is ruled out now, bf16 not.
    first.beside[bf16[0].key()] = new[1].key()
    first.critical = frozenset(n for n, _, _ in sets[0])
    assert auto._rebuilt(first, fig, new[0].key()) is None
    together, points = auto._timed_together(layouts, fig)
    assert set(together) == {bf16[0].key() + "\n" + new[1].key()} and len(points) == 2
    # ... so the whole-step rule leaves the layouts' own choices.
    plans = {lay: lay.plan[1] for lay in layouts}
    assert auto._joint_back(layouts, plans, 0.0) is plans


def test_a_timed_step_is_forgotten_after_its_intervals_and_its_age_is_kept():
    # A plan timed once, then another plan timed at every interval's end: the first
    # one's step weighs at its interval's end and at TIMED_INTERVALS_KEPT more, then
    # is forgotten (steps, beside, age); an end at which no layout ran is no interval.
    # A checkpoint record keeps each step's age, and a restored layout counts it on
    # from the restoring planner's intervals; a row written before steps aged reads
    # as timed then.
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    old = planner.make_plan(GRADIENTS, fig, 0.05, only={n: "bf16" for n, _, _ in GRADIENTS})
    current = planner.make_plan(GRADIENTS, fig, 0.05)
    kept = autoplan.TIMED_INTERVALS_KEPT
    # pylint: disable=protected-access
    lay = auto._layout(tuple(GRADIENTS))
    auto._figures = (ops.generation, fig)
    lay.plan = (ops.generation, old)
    auto._timed([lay], 0.100, 0.001)
    lay.plan = (ops.generation, current)
    for _ in range(kept):
        auto._timed([lay], 0.120, 0.001)
        auto._timed([], 0.120, 0.001)
    assert auto.intervals == kept + 1
    assert set(lay.steps) == set(lay.beside) == {old.key(), current.key()}
    rows = {row[0]: row for row in auto.snapshot()["layouts"][0]["steps"]}
    assert rows[old.key()][5] == kept and rows[current.key()][5] == 0
    back = _tracking_planner()[1]
    back.intervals = 3
    restored = back._layout(tuple(GRADIENTS))
    autoplan.AutoPlanner._take_part(restored, auto.snapshot()["layouts"][0], back.intervals)
    assert restored.timed_at == {old.key(): 3 - kept, current.key(): 3}
    # One interval more: the old plan's step is forgotten here and in the restored one.
    for planner_, layout in ((auto, lay), (back, restored)):
        layout.plan = (ops.generation, current)
        planner_._figures = (ops.generation, fig)
        planner_._timed([layout], 0.120, 0.001)
        assert set(layout.steps) == set(layout.beside) == set(layout.timed_at) == {
            current.key()}
    # A row without an age: timed at the intervals given.
    part = auto.snapshot()["layouts"][0]
    for row in part["steps"]:
        del row[5:]
    autoplan.AutoPlanner._take_part(restored, part, 7)
    assert restored.timed_at == {current.key(): 7}


@pytest.mark.parametrize("fp32_step", [0.100, 0.400])
def test_a_critical_regime_takes_a_timed_plan_it_allows_where_it_ran_faster(fp32_step):
    # The quantized plan ran 200 ms, float32 everywhere ran before it. Every gradient
    # turns critical: the quantized plan is ruled out, so a plan must be left. Float32,
    # allowed, is taken over the planner's new critical plan where its own step beats
    # that plan's prediction, and the new plan otherwise.
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    fp32 = planner.make_plan(GRADIENTS, fig, 0.05, only={n: "fp32" for n, _, _ in GRADIENTS})
    quantized = planner.make_plan(GRADIENTS, fig, 0.05)
    # pylint: disable=protected-access
    lay = _timed_layout(ops, auto, fig, quantized, [(fp32, fp32_step), (quantized, 0.200)])
    lay.critical = "all"
    assert auto._as_running(lay, fig, quantized) is None
    new = auto._planned(lay, fig)
    assert new.key() not in (fp32.key(), quantized.key())
    timed = auto._timed_plans(lay, fig, quantized)
    assert set(timed) == {fp32.key()}
    faster = planner.timed_seconds(*timed[fp32.key()])[0] < new.paced_seconds()
    assert faster == (fp32_step == 0.100)
    taken = auto._decide([lay])[lay]
    assert taken.key() == (fp32.key() if faster else new.key())
    assert auto.went_back == int(faster)


def test_a_new_plan_that_does_not_pay_leaves_a_faster_timed_plan_to_be_taken(monkeypatch,
                                                                            caplog):
    # The quantized plan, current, ran 200 ms and one of rank 2 on every matrix
    # 100 ms: a steep slope. The planner's new choice (less communication still) is
    # predicted below both, so it would be tried, but here a change is made not to
    # pay (``change_pays``); the current plan then still gives way to the rank-2 one
    # its steps showed faster.
    ops, auto = _tracking_planner()
    fig = all_figures(1.0)
    low_rank = planner.LowRank(2, MEASURED)
    free = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank,
                             only={name: "rqsgd4" if name == "embed" else "psgd2"
                                   for name, _, _ in GRADIENTS})
    quantized = planner.make_plan(GRADIENTS, fig, 0.05)
    # pylint: disable=protected-access
    lay = _timed_layout(ops, auto, fig, quantized, [(quantized, 0.200), (free, 0.100)])
    new = auto._planned(lay, fig)
    timed = auto._timed_plans(lay, fig, quantized)
    assert new.key() not in timed
    assert new.paced_seconds() < min(planner.timed_seconds(*v)[0] for v in timed.values())
    # The kept plan is priced (a measured slope), as a change that does not pay needs.
    assert new.pace.measured_slope
    monkeypatch.setattr(planner, "change_pays", lambda kept, new, min_gain_s, share: False)
    caplog.set_level(logging.INFO, logger="absl")
    assert auto._decide([lay])[lay].key() == free.key()
    assert auto.went_back == 1
    # The log says what the new plan would save or lose, at the pace and at the worst
    # pace the steps allow (a slope's end can make a saving a loss).
    kept = auto._timed_plans(lay, fig, quantized)[quantized.key()][0]
    least = planner.least_gain(kept, new)
    worst = (f"save {least * 1e3:.3f} ms" if least >= 0 else f"lose {-least * 1e3:.3f} ms")
    said = [r.getMessage() for r in caplog.records if "keeps its plan" in r.getMessage()]
    assert len(said) == 1 and f"{worst} at the worst pace the steps allow" in said[0]
    # ... and why it is not a trial either: what it would save or lose within one
    # standard error of the slope.
    near = planner.least_gain(kept, new, near=True)
    assert (f"at one standard error of its slope, where it would "
            f"{'save' if near >= 0 else 'lose'} {abs(near) * 1e3:.3f} ms") in said[0]


TABLE_AFTER = 2  # the embedding table's index among TABLE_GRADIENTS


def table_gradients(shape):
    """GRADIENTS with an embedding table of ``shape`` after fc1."""
    return GRADIENTS[:TABLE_AFTER] + [("table", shape, "float32")] + GRADIENTS[TABLE_AFTER:]


@pytest.mark.parametrize("dense", [frozenset(), frozenset([0])])
def test_a_timed_plans_key_gives_its_choice_back_tables_included(dense):
    # A layout as the planner keeps it (the table's tuple marked as one); its plan,
    # made again from the key alone, is the same plan: the timed steps of a
    # checkpoint name their plans by key.
    layout = tuple(g if g[0] != "table" else g + ("table",)
                   for g in table_gradients((20000, 64)))
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    ops = strategy.cross_device_ops
    auto = ops._auto  # pylint: disable=protected-access
    # pylint: disable=protected-access
    lay = auto._layout(layout)
    lay.critical, lay.rows = frozenset(), {0: (500, 2000)}
    fig = all_figures(0.1)
    plan = auto._planned(lay, fig, dense=dense, rows_label=None if dense else "bf16")
    labels, places, rows_label = autoplan._choice_of(plan.key(), layout)
    assert places == dense and rows_label == (None if dense else "bf16")
    assert labels == {e.name: e.label for e in plan.entries}
    assert auto._planned(lay, fig, only=labels, dense=places,
                         rows_label=rows_label).key() == plan.key()
    for key in ("", "fp32", "auto:", "auto:=bf16@allreduce", "auto:fc1"):
        assert autoplan._choice_of(key, layout) == (None, None, None)
    # A plan of tables alone, sent as rows: no entries, which is a choice too.
    assert autoplan._choice_of("auto:table=rows:qsgd8", layout) == ({}, frozenset(), "qsgd8")


@pytest.mark.parametrize("shape,rows,dense", [
    # Every row of a small table touched: summed, it goes low-rank for less than its rows.
    ((2000, 256), 2000, True),
    # A large vocabulary of which a batch touches few rows: the rows are far fewer bytes.
    ((50000, 256), 800, False),
])
def test_each_table_goes_as_rows_or_dense_whichever_the_plan_prices_faster(shape, rows, dense):
    fig = all_figures(0.1)
    gradients = table_gradients(shape)
    measured = dict(MEASURED, table=spectrum_errors(0.7 ** np.arange(256)))
    kwargs = dict(low_rank=planner.LowRank(2, measured))
    tables = {TABLE_AFTER: (rows, 4 * rows)}
    fixed = {d: planner.plan_tables(gradients, tables, fig, 0.05, dense=d, **kwargs)
             for d in (frozenset(), frozenset([0]))}
    plan = planner.plan_tables(gradients, tables, fig, 0.05, **kwargs)
    # The choice is the faster of the two, each priced in full.
    assert plan.key() == min(fixed.values(), key=planner.Plan.paced_seconds).key()
    (table,) = plan.tables
    assert table.dense == dense and table.rows == rows and table.name == "table"
    names = [e.name for e in plan.entries]
    assert ("table" in names) == dense
    assert names == [g[0] for g in gradients if g[0] != "table" or dense]  # in order
    rows_plan = fixed[frozenset()]
    (as_rows,) = rows_plan.tables
    assert f"table=rows:{as_rows.label}" in rows_plan.key()
    # Dense, the table loses no more than its rows would, outside the quantizers'
    # budget, which the other gradients keep to.
    dense_plan = fixed[frozenset([0])]
    (entry,) = [e for e in dense_plan.entries if e.name == "table"]
    rows_bound = planner.BY_LABEL[as_rows.label].variance_bound(int(np.prod(shape)))
    assert entry.candidate.rank is not None or entry.error <= rows_bound
    others = [e for e in dense_plan.entries if e.name != "table"]
    assert dense_plan.mean_error == pytest.approx(
        sum(e.error * np.prod(e.shape) for e in others if e.candidate.rank is None)
        / sum(np.prod(e.shape) for e in others))
    assert dense_plan.mean_error <= 0.05
    # The rows' bytes and time count in the step as the entries' do.
    assert as_rows.sent_bytes > 0 and as_rows.wire_s == pytest.approx(
        as_rows.sent_bytes * fig.link().beta)
    assert rows_plan.step_seconds() > planner.make_plan(
        [g for g in gradients if g[0] != "table"], fig, 0.05, **kwargs).step_seconds()
    # More rows, more bytes: a rows table is priced from its count.
    more = planner.plan_tables(gradients, {TABLE_AFTER: (2 * rows, 8 * rows)}, fig, 0.05,
                               dense=frozenset(), **kwargs)
    assert more.tables[0].sent_bytes > as_rows.sent_bytes


def test_a_dense_table_takes_no_quantizer_lossier_than_its_rows():
    # A budget that keeps the other gradients near bf16: the rows go as bf16, and so
    # must the table dense, though outside the budget rotated 4 bits would be faster.
    fig, gradients = all_figures(0.1), table_gradients((2000, 256))
    plan = planner.plan_tables(gradients, {TABLE_AFTER: (2000, 8000)}, fig, 1e-4,
                               dense=frozenset([0]))
    (table,) = plan.tables
    (entry,) = [e for e in plan.entries if e.name == "table"]
    bound = planner.BY_LABEL[table.label].variance_bound(2000 * 256)
    assert table.dense and table.label == "bf16"
    assert entry.error <= bound and plan.mean_error <= 1e-4
    uncapped = planner.make_plan(gradients, fig, 1e-4, capped={"table": float("inf")})
    (free,) = [e for e in uncapped.entries if e.name == "table"]
    assert free.error > bound  # the cap is what holds it


def test_a_table_not_counted_yet_goes_as_rows_priced_at_nothing():
    gradients = table_gradients((2000, 256))
    plan = planner.plan_tables(gradients, {TABLE_AFTER: (0, 0)}, all_figures(0.1), 0.05)
    (table,) = plan.tables
    assert not table.dense and table.sent_bytes == 0 and table.cpu_s == 0
    assert "rows not counted yet" in plan.table()
    # Under a float32 plan the rows take the stock gather, priced from their occurrences.
    fast = planner.plan_tables(gradients, {TABLE_AFTER: (100, 400)}, all_figures(1000.0), 0.0)
    (table,) = fast.tables
    assert table.label == "fp32"
    assert table.sent_bytes == 400 * (256 * 4 + 4) * (fast.num_workers - 1)


def test_a_table_planned_alone_goes_as_the_fastest_of_quantized_and_float32_rows():
    # A bag of embeddings under a head too small to plan: nothing beside the table gives
    # its rows the plan's view of the link. Before its rows are counted they take the
    # quantizer of the fewest bytes within the budget (within bf16's bound while the
    # table is critical); counted, whichever of the quantizers within the budget and
    # float32 on the stock gather the plan prices fastest.
    gradients = [("table", (50000, 64), "float32")]
    budget = 0.05
    fewest = min((c for c in planner.CANDIDATES[1:]
                  if c.variance_bound(embeddings.BLOCK_ENTRIES) <= budget),
                 key=lambda c: planner.sent_bytes(c, "allgather", (embeddings.BLOCK_ENTRIES,),
                                                  "float32", 4))
    uncounted = planner.plan_tables(gradients, {0: (0, 0)}, all_figures(0.1), budget)
    assert uncounted.entries == () and uncounted.tables[0].label == fewest.label != "fp32"
    critical = planner.plan_tables(gradients, {0: (0, 0)}, all_figures(0.1), budget,
                                   critical={"table"})
    label = critical.tables[0].label
    assert planner.BY_LABEL[label].variance_bound(embeddings.BLOCK_ENTRIES) <= \
        planner.CRITICAL_BOUND
    # Counted: on a slow link the quantized rows, on a link whose bytes cost nothing the
    # stock gather (no encoding), each the faster as priced in full.
    for link_gbps, expected in ((0.1, fewest.label), (1e6, "fp32")):
        fig = all_figures(link_gbps)
        plan = planner.plan_tables(gradients, {0: (800, 3200)}, fig, budget, dense=frozenset())
        assert plan.tables[0].label == expected, link_gbps
        other = planner.plan_tables(gradients, {0: (800, 3200)}, fig, budget, dense=frozenset(),
                                    rows_label="fp32" if expected != "fp32" else fewest.label)
        assert plan.paced_seconds() < other.paced_seconds()
    # Rotated and plain 8 bits send the same bytes: at the same cost the rotated (less
    # error) is kept; where its transform costs more, the plain one goes, priced faster.
    assert planner.sent_bytes(planner.BY_LABEL["rqsgd8"], "allgather",
                              (embeddings.BLOCK_ENTRIES,), "float32", 4) == \
        planner.sent_bytes(planner.BY_LABEL["qsgd8"], "allgather",
                           (embeddings.BLOCK_ENTRIES,), "float32", 4)
    for rotation, expected in ((1.0, "rqsgd8"), (3.0, "qsgd8")):
        fig = all_figures(0.1, rotation=rotation)
        plan = planner.plan_tables(gradients, {0: (800, 3200)}, fig, budget)
        assert plan.tables[0].label == expected and not plan.tables[0].dense, rotation
        if rotation != 1.0:
            rotated = planner.plan_tables(gradients, {0: (800, 3200)}, fig, budget,
                                          dense=frozenset(), rows_label="rqsgd8")
            assert plan.paced_seconds() < rotated.paced_seconds()
    # The budget bounds them: 4 bits only where it allows them, and the critical
    # bound while the table is critical.
    loose = planner.plan_tables(gradients, {0: (800, 3200)}, all_figures(0.1), 0.1)
    assert loose.tables[0].label == "rqsgd4"
    assert planner.BY_LABEL["rqsgd4"].variance_bound(embeddings.BLOCK_ENTRIES) > budget
    critical = planner.plan_tables(gradients, {0: (800, 3200)}, all_figures(0.1, rotation=3.0),
                                   budget, critical={"table"})
    assert critical.tables[0].label == "bf16"
    assert planner.BY_LABEL["bf16"].variance_bound(embeddings.BLOCK_ENTRIES) <= \
        planner.CRITICAL_BOUND < planner.BY_LABEL["rqsgd8"].variance_bound(
            embeddings.BLOCK_ENTRIES)
    # Rows a restored or running plan sent in a quantizer the budget or the critical
    # bound now rules out: no plan of that choice (the caller plans afresh).
    fig = all_figures(0.1)
    for label, kwargs in (("rqsgd4", {}), ("qsgd8", {"critical": {"table"}})):
        assert planner.plan_tables(gradients, {0: (800, 3200)}, fig, budget, dense=frozenset(),
                                   rows_label=label, **kwargs) is None, label
    for label, kwargs in (("qsgd8", {}), ("bf16", {"critical": {"table"}}), ("fp32", {})):
        assert planner.plan_tables(gradients, {0: (800, 3200)}, fig, budget, dense=frozenset(),
                                   rows_label=label, **kwargs).tables[0].label == label


def test_a_dense_table_loses_its_own_low_rank_share_and_lends_none_to_the_others():
    # The low-rank budget is what PowerSGD at rank 2 would lose on each measured
    # matrix. A table summed dense may lose up to its own share; the other gradients
    # keep to theirs whichever way the table goes. Before, a dense table's share joined
    # the others': sent whole, it let them lose more, so dense won for the budget it
    # freed rather than for its time.
    fig = all_figures(0.1)
    gradients = [("table", (2000, 256), "float32"), ("fc", (2048, 2048), "float32")]
    measured = {"table": spectrum_errors(10.0 * np.ones(256)),  # rank 2 loses 99 %
                "fc": spectrum_errors([1.0, 1.0] + [0.05] * 500)}  # rank 1: 69 %, 2: 38 %
    low_rank = planner.LowRank(2, measured)
    own = {name: sq * rel[2] for name, (sq, rel) in measured.items()}
    assert own["table"] > 100 * own["fc"]
    (alone,) = planner.make_plan(gradients[1:], fig, 0.05, low_rank=low_rank).entries
    # Alone, the fewest bytes its share allows: rank 2 (rank 1 would lose 69 %).
    assert alone.label == "psgd2"
    for dense in (frozenset(), frozenset({0}), None):
        plan = planner.plan_tables(gradients, {0: (2000, 8000)}, fig, 0.05, dense=dense,
                                   low_rank=low_rank)
        entries = {e.name: e for e in plan.entries}
        assert entries["fc"].label == alone.label, (dense, plan.table())
        assert measured["fc"][0] * entries["fc"].error <= own["fc"] * (1 + 1e-9)
        table = entries.get("table")
        assert (table is not None) == (dense == frozenset({0}) or (
            dense is None and plan.tables[0].dense))
        if table is not None and table.candidate.error_key is not None:
            assert table.error <= measured["table"][1][2]
        # The budget is every matrix's share, the table's too whichever way it goes: a
        # share is in the same units for every choice.
        assert plan.low_rank_budget == pytest.approx(own["fc"] + own["table"])


def test_a_dense_tables_share_does_not_make_the_others_steps_cheaper():
    # Under a pace, a plan's low-rank error costs steps in proportion to its share of
    # the budget. The budget was that of the gradients planned, so a table summed dense
    # whose own rank-2 loss is large made every other gradient's share small: the rows
    # plan (the hidden matrix at 100 % of a budget of its own) paid a whole budget's
    # steps, the dense one (the same matrix, the table quantized) almost none, and dense
    # won for it on a step three times as long (a cluster test's plan sent a 16-row
    # table of 4096 top-k over an all-gather for this, on a slow machine).
    fig = all_figures(0.1)
    gradients = [("table", (2000, 256), "float32"), ("fc", (2048, 2048), "float32")]
    measured = {"table": spectrum_errors(10.0 * np.ones(256)),  # rank 2 loses 99 %
                "fc": spectrum_errors([1.0, 1.0] + [0.05] * 500)}
    low_rank = planner.LowRank(2, measured)
    pace = planner.Pace(compute_s=0.05, scale=1.0, low_rank_steps=1.0)
    for rows in (50, 400):
        tables = {0: (rows, 4 * rows)}
        plans = {d: planner.plan_tables(gradients, tables, fig, 0.05, dense=frozenset(d),
                                        low_rank=low_rank, pace=pace) for d in ((), (0,))}
        rows_plan, dense_plan = plans[()], plans[(0,)]
        assert not rows_plan.tables[0].dense and dense_plan.tables[0].dense
        # The same budget either way, and the same share for the same matrix's loss.
        assert rows_plan.low_rank_budget == pytest.approx(dense_plan.low_rank_budget)
        fc = {p: [e for e in plan.entries if e.name == "fc"][0] for p, plan in plans.items()}
        for p, plan in plans.items():
            table = [e for e in plan.entries if e.name == "table"]
            lost = measured["fc"][0] * fc[p].error + (
                measured["table"][0] * table[0].error
                if table and table[0].candidate.error_key is not None else 0.0)
            assert plan.low_rank_share == pytest.approx(lost / plan.low_rank_budget)
            # Whatever the steps' price does to the table, the matrix keeps to its own
            # share (it went to rank 1, 69 % lost, with the table dense).
            assert measured["fc"][0] * fc[p].error <= measured["fc"][0] * measured["fc"][1][2] \
                * (1 + 1e-9), plan.table()
        # Here the rows are the faster step; the choice takes them, by time.
        assert rows_plan.step_seconds() < dense_plan.step_seconds()
        chosen = planner.plan_tables(gradients, tables, fig, 0.05, low_rank=low_rank, pace=pace)
        assert not chosen.tables[0].dense, chosen.table()
        assert chosen.paced_seconds() == pytest.approx(
            min(p.paced_seconds() for p in plans.values()))


@pytest.mark.parametrize("decay", [0.3, 0.7])
def test_under_a_pace_a_dense_table_leaves_the_others_their_whole_share(decay):
    # The price of the others' low-rank budget is the least that keeps them within it,
    # found for each price of the steps the plan weighs. It was found once, with no
    # steps priced, where the table summed dense went low rank and the matrix with it;
    # priced steps moved the table to 8-bit, and the matrix, still paying the price
    # that had held them both, went to rank 4 or 8-bit (1.2x and 1.8x the step here)
    # where its own share is rank 2. The plan is the fastest of every pair of options
    # the budgets allow.
    fig = all_figures(1.0)
    gradients = [("table", (2000, 256), "float32"), ("fc", (2048, 2048), "float32")]
    measured = {"table": spectrum_errors(10.0 * np.ones(256)),
                "fc": spectrum_errors(decay ** np.arange(2048))}
    kwargs = dict(low_rank=planner.LowRank(2, measured),
                  pace=planner.Pace(compute_s=0.05, scale=1.0, low_rank_steps=1.0),
                  capped={"table": planner.BY_LABEL["rqsgd8"].variance_bound(2000 * 256)})
    plan = planner.make_plan(gradients, fig, 0.05, **kwargs)
    labels = [c.label for c in planner.ALL]
    allowed = [p for p in (planner.make_plan(gradients, fig, 0.05, only={"table": a, "fc": b},
                                             **kwargs)
                           for a in labels for b in labels) if p is not None]
    fastest = min(allowed, key=lambda p: p.paced_seconds())
    assert plan.paced_seconds() == pytest.approx(fastest.paced_seconds(), rel=1e-9), \
        (plan.table(), fastest.table())
    # Which is the matrix at its own share's rank, the table quantized.
    assert [e.label for e in plan.entries] == ["rqsgd8", "psgd2"], plan.table()


def test_the_plans_all_float32_figure_holds_the_tables_rows_as_the_stock_gather():
    # The plan table's "all float32" line: the planned gradients on one all-reduce, and
    # a table sent as rows as the stock gather sends its rows (every occurrence's
    # float32 values and int32 index, from each of the other workers), with the
    # latency of two all-gathers, as the plan's own rows are priced.
    gradients = [("table", (50000, 64), "float32"), ("head", (512, 512), "float32")]
    fig = all_figures(0.1)
    plan = planner.plan_tables(gradients, {0: (800, 3200)}, fig, 0.05, dense=frozenset())
    assert plan.rows_tables and [e.name for e in plan.entries] == ["head"]
    link, n = fig.link(), fig.num_workers
    got = plan.predicted()
    assert got["fp32_wire_s"] == pytest.approx(
        link.wire("allreduce", n, 512 * 512 * 4) + (n - 1) * 3200 * (64 * 4 + 4) * link.beta)
    assert got["fp32_latency_s"] == pytest.approx(
        link.latency("allreduce", n) + 2 * link.latency("allgather", n))
    # The table sent dense: among the all-reduce's bytes, no gather.
    dense = planner.plan_tables(gradients, {0: (800, 3200)}, fig, 0.05, dense=frozenset({0}))
    assert not dense.rows_tables
    assert dense.predicted()["fp32_wire_s"] == pytest.approx(
        link.wire("allreduce", n, (50000 * 64 + 512 * 512) * 4))


def test_rows_are_priced_as_one_encoding_and_one_decoding_of_all_their_blocks():
    # The traced step encodes a table's blocks in one loop and decodes every worker's
    # in another: each priced as one call on all its elements, not a call per block
    # (which paid the figures' per-call cost, about 50 us here, 48 times for 16 blocks
    # on 2 workers).
    fig = all_figures(0.1, num_workers=2)
    table = planner.Table(place=0, name="table", shape=(100000, 64), dtype="float32",
                          dense=False, rows=1000, tokens=4096, label="")
    r = embeddings.block_rows_of(table.shape)
    blocks = -(-1000 // r)
    assert blocks > 1
    for label in ("rqsgd8", "bf16"):
        priced = planner.rows_table(table, planner.BY_LABEL[label], fig)
        elements = blocks * r * 64
        assert priced.cpu_s == pytest.approx(
            fig.encode(label)(elements) + fig.decode(label)(2 * elements))
        per_block = blocks * (fig.encode(label)(r * 64) + 2 * fig.decode(label)(r * 64))
        assert priced.cpu_s < per_block - 2 * (blocks - 1) * 40e-6


def test_embedding_rows_travel_as_the_plans_quantizer_or_the_fewest_bytes_in_budget():
    # AutoPlanner.row_compressor under plans of given labels: float32 everywhere sends
    # the rows on the stock gather; otherwise the quantizer carrying most elements; a
    # plan that quantizes nothing but sends low-rank, the quantizer of the fewest bytes
    # an element within its error budget, ties to the least error.
    import dataclasses

    base = planner.make_plan(GRADIENTS, figures(), 0.05)

    def rows(labels, budget=0.05):
        plan = dataclasses.replace(
            base, error_budget=budget,
            entries=tuple(dataclasses.replace(e, label=label)
                          for e, label in zip(base.entries, labels)))
        return autoplan.AutoPlanner.row_compressor(plan)

    def compressor(label):
        return planner.BY_LABEL[label].compressor

    assert [e.name for e in base.entries] == ["embed", "fc1", "fc2", "conv", "head"]
    assert rows(["fp32"] * 5) is None
    # fc1 (4 M elements) outweighs embed and fc2 together (3 M).
    assert rows(["qsgd8", "bf16", "qsgd8", "fp32", "rqsgd4"]) == compressor("bf16")
    assert rows(["rqsgd4", "psgd2", "qsgd8", "fp32", "fp32"]) == compressor("rqsgd4")
    low_rank = ["psgd2", "psgd4", "psgd1", "fp32", "fp32"]
    # 8 bits an element: rotated 8-bit QSGD (0.00025) ties plain (0.032) on bytes.
    assert rows(low_rank) == compressor("rqsgd8")
    assert rows(low_rank, 0.07) == compressor("rqsgd4")  # 4 bits, bound 0.068
    assert rows(low_rank, 1e-4) == compressor("bf16")  # only bf16's 2**-16 fits
    assert rows(low_rank, 0.0) is None
    # While a gradient is critical, the rows take no more error than critical ones do.
    base = dataclasses.replace(base, entries=tuple(
        dataclasses.replace(e, critical=e.name == "fc1") for e in base.entries))
    assert rows(low_rank) == compressor("bf16")
    assert rows(["fp32", "fp32", "rqsgd4", "fp32", "fp32"]) == compressor("rqsgd4")


def test_low_rank_must_save_more_than_the_steps_it_adds_cost():
    low_rank = planner.LowRank(2, MEASURED)
    fig = all_figures(1.0)
    free = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank)  # the step alone
    quantized = planner.make_plan(GRADIENTS, fig, 0.05)
    assert free.low_rank_share > 0 and quantized.low_rank_share == 0
    step = free.step_seconds()

    def labels(plan):
        return {e.name: e.label for e in plan.entries}

    shares = []
    for compute in (0.0, step, 10 * step, 1000 * step):
        pace = planner.Pace(compute, 0.5, 0.3)
        plan = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, pace=pace)
        assert plan.pace == pace
        assert plan.low_rank_error <= plan.low_rank_budget * (1 + 1e-9)
        assert plan.mean_error <= 0.05 + 1e-12
        # Never slower to the same accuracy, as the pace weighs them, than the plan of
        # the step alone or the plan without low rank, both priced under this pace.
        for other in (free, quantized):
            priced = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank,
                                       only=labels(other), pace=pace)
            assert plan.paced_seconds() <= priced.paced_seconds() * (1 + 1e-12), compute
        shares.append(plan.low_rank_share)
    # The more of a step is compute, the less of the budget is worth its steps. At
    # compute C, a share u of it costs 0.3 u C a step and can save at most the scaled
    # communication of the plan without low rank, so u <= 0.5 c / (0.3 C): where the
    # step is mostly compute, only what loses next to nothing (fc1, nearly rank 1)
    # stays low-rank.
    assert all(a >= b for a, b in zip(shares, shares[1:])), shares
    assert shares[0] > 0
    assert shares[-1] <= 0.5 * quantized.step_seconds() / (0.3 * 1000 * step), shares
    # No extra steps priced: the step alone decides, as without a pace.
    unpriced = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank,
                                 pace=planner.Pace(1000 * step))
    assert unpriced.key() == free.key()
    # A change is weighed as the plans were chosen: the low-rank plan, kept, against
    # the one without, under a pace where compute is most of the step.
    pace = planner.Pace(1000 * step, 0.5, 0.3)
    kept = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, only=labels(free),
                             pace=pace)
    new = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=low_rank, pace=pace)
    assert new.step_seconds() > kept.step_seconds()  # a longer step...
    assert planner.change_pays(kept, new, 0.0)  # ... that reaches the accuracy sooner
    assert "more steps for its low-rank error" in kept.table()


def test_the_plan_callback_prices_a_change_by_the_step_that_retraces():
    # One worker: nothing planned, but a change of setting retraces the train function
    # as a new plan does; the callback prices the step after it against the others.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    model = small_model(strategy)
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=50, link_margin=None)
    import tf_keras as keras

    steps = []

    class Change(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            steps.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            steps[-1] = time.perf_counter() - steps[-1]
            if batch == 10:
                cdo = strategy.cross_device_ops
                cdo.overlap_bytes = cdo.overlap_bytes + 1  # a new generation

    model.fit(*small_data(160), batch_size=8, epochs=1, verbose=0,
              callbacks=[Change(), callback])
    ordinary = float(np.median(steps[1:11] + steps[12:]))
    # The retrace, and the step settling after it where it ran over.
    settled = steps[12:12 + tfgc.keras.AutoPlanCallback.SETTLE_STEPS]
    want = steps[11] - ordinary + sum(max(s - ordinary, 0.0) for s in settled)
    assert callback.change_s == pytest.approx(want, rel=0.5, abs=0.02)
    assert callback.change_s > 3 * ordinary  # a retrace, not a step
    # The plan's steps since the change leave out the retrace and the settling step.
    timed = list(callback._plan_steps)  # pylint: disable=protected-access
    assert len(timed) == len(steps) - 12 - tfgc.keras.AutoPlanCallback.SETTLE_STEPS
    np.testing.assert_allclose(timed, steps[-len(timed):], rtol=0.2, atol=2e-3)


def _drive(callback, monkeypatch, durations, change_after=None, measuring_s=0.0,
           end=False):
    """Runs ``callback``'s hooks over steps of the given seconds on a fake clock, the
    strategy's setting changed (a new generation) at the end of step ``change_after``
    (or of each step in it, a collection), ``measuring_s`` of the first step's counted
    as the planner's measuring, and the fit ended (``end``)."""
    from tfgc.keras import callbacks as callbacks_module
    now = [0.0]
    monkeypatch.setattr(callbacks_module, "time",
                        type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    cdo = callback._strategy.cross_device_ops  # pylint: disable=protected-access
    changes = {change_after} if isinstance(change_after, int) else set(change_after or ())
    callback.set_params({"epochs": 1, "steps": len(durations), "verbose": 0})
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    for k, seconds in enumerate(durations):
        callback.on_train_batch_begin(k)
        now[0] += seconds
        if k == 0:
            cdo._auto.measuring_s += measuring_s  # pylint: disable=protected-access
        if k in changes:
            cdo.overlap_bytes = cdo.overlap_bytes + 1
        callback.on_train_batch_end(k)
    if end:
        callback.on_train_end()


def test_the_plan_callback_times_settled_steps_and_prices_a_change_exactly(monkeypatch):
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    cdo = strategy.cross_device_ops
    measured = []
    measure = cdo.measure_low_rank
    monkeypatch.setattr(cdo, "measure_low_rank",
                        lambda step_s=None, step_se_s=None, steps_left=None, min_gain_s=0.0,
                        trial_steps=None:
                        measured.append((step_s, step_se_s, steps_left, min_gain_s,
                                         trial_steps))
                        or measure(step_s, step_se_s, steps_left, min_gain_s, trial_steps))
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=50, link_margin=None)
    assert callback.SETTLE_STEPS == 1 and callback.LOW_RANK_AFTER == 2
    # The trace (6 s of it the planner's measuring), a settling step, three of the
    # plan's, then (after a change) its retrace, a settling step and two of the new
    # plan's.
    _drive(callback, monkeypatch, [10.0, 2.0, 1.0, 0.8, 1.2, 5.0, 1.5, 0.9, 1.1],
           change_after=4, measuring_s=6.0)
    # Measured once, after the second of the plan's steps, at the lesser of the two,
    # with the error of two steps of their spread (1.4826 times the median absolute
    # deviation, 0.1 s), and the fit's steps after it (five of nine). No change was
    # timed yet: the first trace stands for one, its excess and the settling step's
    # over the ordinary step then (1.0), less the measuring, over the interval (50
    # steps, more than the fit's left). A trial taken then would run to the interval's
    # end: 46 steps after the fourth.
    trace_s = (10.0 - 6.0 - 1.0) + (2.0 - 1.0)
    assert measured == [(pytest.approx(0.8), pytest.approx(1.4826 * 0.1), 5,
                         pytest.approx(trace_s / 50), 46)]
    assert list(callback._plan_steps) == pytest.approx([0.9, 1.1])  # pylint: disable=protected-access
    # The retrace's and the settling step's excess over the median of the ordinary
    # steps (1.0, 0.8 and 1.2, priced once the settling step ended; the trace's and the
    # first settling step's are not among them).
    assert callback.change_s == pytest.approx((5.0 - 1.0) + (1.5 - 1.0))
    # A later fit's first trace does not stand for a change once one was timed.
    _drive(callback, monkeypatch, [20.0, 1.0, 1.0, 1.0, 1.0])
    assert callback.change_s == pytest.approx((5.0 - 1.0) + (1.5 - 1.0))


def test_the_plan_callback_warns_where_changes_of_plan_take_much_of_the_fit(monkeypatch,
                                                                           caplog):
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    caplog.set_level(logging.WARNING, logger="absl")
    # Two changes, each a retrace of 6 s and a settling step of 1 s over ordinary steps
    # of 1 s: 5 s each, 10 s of a fit of 25 s. The first step's trace is not a change.
    callback = tfgc.keras.AutoPlanCallback(strategy, threshold=None, every_steps=4,
                                           link_margin=None)
    durations = [3.0, 1.0, 1.0, 1.0, 1.0, 6.0, 1.0, 1.0, 1.0, 6.0, 1.0, 1.0, 1.0]
    _drive(callback, monkeypatch, durations, change_after={4, 8}, end=True)
    assert callback.retraces == pytest.approx([5.0, 5.0])
    warned = [r.getMessage() for r in caplog.records if "changes of plan took" in r.getMessage()]
    assert len(warned) == 1
    assert "2 changes of plan took 10.0 s of this fit's 25.0 s (40%" in warned[0]
    assert "every_steps=4 plans again less often" in warned[0]
    # With regimes, the message names them: they move more over a short interval.
    cdo = strategy.cross_device_ops
    monkeypatch.setattr(cdo, "capture_gradients", lambda: None)
    monkeypatch.setattr(cdo, "adapt", lambda threshold, **kwargs: frozenset())
    caplog.clear()
    regimes = tfgc.keras.AutoPlanCallback(strategy, every_steps=4, link_margin=None)
    _drive(regimes, monkeypatch, durations, change_after={4, 8}, end=True)
    warned = [r.getMessage() for r in caplog.records if "changes of plan took" in r.getMessage()]
    assert len(warned) == 1 and "critical regimes move" in warned[0]
    assert "every_steps=4 sums more steps" in warned[0]
    # The same two changes in a fit five times as long: under RETRACE_SHARE, no word;
    # nor for one change alone, however costly.
    caplog.clear()
    _drive(callback, monkeypatch, durations + [1.0] * 90, change_after={4, 8}, end=True)
    assert callback.retraces == pytest.approx([5.0, 5.0])
    _drive(callback, monkeypatch, durations[:8], change_after={4}, end=True)
    assert callback.retraces == pytest.approx([5.0])
    assert not [r for r in caplog.records if "changes of plan took" in r.getMessage()]


def test_until_a_change_is_timed_the_costliest_first_step_stands_for_one(monkeypatch):
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=50, link_margin=None)
    _drive(callback, monkeypatch, [4.0, 1.0, 1.0, 1.0])
    assert callback.change_s == pytest.approx(4.0 - 1.0)
    # A second fit whose first step reused the traced function: its small excess does
    # not replace the trace's; a costlier one does.
    _drive(callback, monkeypatch, [1.5, 1.0, 1.0, 1.0])
    assert callback.change_s == pytest.approx(4.0 - 1.0)
    _drive(callback, monkeypatch, [6.0, 1.0, 1.0, 1.0])
    assert callback.change_s == pytest.approx(6.0 - 1.0)


def test_an_interval_that_ends_before_the_first_trace_is_priced_still_pays_for_it(monkeypatch):
    # An interval of two steps ends before any ordinary step is timed: the first trace
    # and its settling step, whole (less the planner's measuring), bound what a change
    # costs, rather than nothing.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    cdo = strategy.cross_device_ops
    asked = []
    monkeypatch.setattr(cdo, "capture_gradients", lambda: None)
    trials = []
    monkeypatch.setattr(cdo, "adapt", lambda threshold, min_gain_s=0.0, **kwargs:
                        asked.append(min_gain_s) or trials.append(kwargs["trial_steps"])
                        or frozenset())
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=2, link_margin=None)
    _drive(callback, monkeypatch, [10.0, 2.0, 1.0, 1.0, 1.0, 1.0], measuring_s=6.0)
    # Six steps: intervals end at steps 2, 4 and 6, over the steps left (4, 2, 0; at
    # least an interval's 2). At step 2: (10 - 6) + 2 s; later, priced against the
    # ordinary steps (1 s): (10 - 6 - 1) + (2 - 1).
    assert asked == pytest.approx([6.0 / 4, 4.0 / 2, 4.0 / 2])
    assert trials == [2, 2, 2]  # a plan taken at an interval's end runs the next
    assert callback.change_s == pytest.approx(4.0)
    # A single call of steps_per_execution steps (4 here) over the first interval:
    # the call's seconds less the measuring, and no ordinary step to price it against.
    asked.clear()
    fresh = tfgc.keras.AutoPlanCallback(strategy, every_steps=4, link_margin=None)
    from tfgc.keras import callbacks as callbacks_module
    now = [0.0]
    monkeypatch.setattr(callbacks_module, "time",
                        type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    fresh.set_params({"epochs": 1, "steps": 8, "verbose": 0})
    fresh.on_train_begin()
    fresh.on_epoch_begin(0)
    fresh.on_train_batch_begin(0)
    now[0] += 12.0
    cdo._auto.measuring_s += 5.0  # pylint: disable=protected-access
    fresh.on_train_batch_end(3)
    assert asked == pytest.approx([7.0 / 4])


def test_a_plans_step_error_comes_from_its_own_steps_once_it_has_enough(monkeypatch):
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=100, link_margin=None)
    SPREAD = callback.SPREAD_FROM
    # A noisy plan (steps of 1 and 3 s), a change, then a steady one (2 s +- 0.01).
    noisy = [1.0, 3.0] * SPREAD
    steady = [2.0 + 0.01 * (-1) ** k for k in range(2 * SPREAD)]

    def error(steps, n):
        steps = np.asarray(steps)
        mad = np.median(np.abs(steps - np.median(steps)))
        return 1.2533 * 1.4826 * mad / math.sqrt(n)

    # Fewer of the steady plan's steps than SPREAD_FROM: the recent steps' spread
    # (both plans'), over the steady plan's count.
    _drive(callback, monkeypatch, [5.0, 1.0] + noisy + [5.0, 1.0] + steady[:3],
           change_after=1 + len(noisy))
    assert callback._plan_step()["step_se_s"] == pytest.approx(error(noisy + steady[:3], 3))  # pylint: disable=protected-access
    # As many or more: its own.
    _drive(callback, monkeypatch, [5.0, 1.0] + noisy + [5.0, 1.0] + steady,
           change_after=1 + len(noisy))
    assert callback._plan_step()["step_se_s"] == pytest.approx(error(steady, len(steady)))  # pylint: disable=protected-access
    assert callback._plan_step()["step_se_s"] < 0.01  # pylint: disable=protected-access
    # Two steps that agree, and no others: the spread is the prior's share of the step.
    fresh = tfgc.keras.AutoPlanCallback(strategy, every_steps=100, link_margin=None)
    _drive(fresh, monkeypatch, [5.0, 1.0, 2.0, 2.0])
    assert fresh._plan_step()["step_se_s"] == pytest.approx(  # pylint: disable=protected-access
        fresh.SPREAD_PRIOR * 2.0)


def test_the_steps_left_count_from_the_fits_first_epoch():
    # A fit resumed at epoch 3 of 5 (``initial_epoch``, BackupAndRestore) has two
    # epochs left, not five; Keras' counts may be NumPy's; unknown lengths are None.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=4, link_margin=None)
    callback.set_params({"epochs": 5, "steps": np.int64(10), "verbose": 0})
    callback.on_train_begin()
    callback.on_epoch_begin(3)
    assert callback._steps_left() == 20 and callback._steps_left(running=3) == 17  # pylint: disable=protected-access
    assert isinstance(callback._steps_left(), int)  # pylint: disable=protected-access
    callback.on_epoch_begin(4)  # later epochs count from the fit's first
    assert callback._steps_left() == 20  # pylint: disable=protected-access
    callback.set_params({"epochs": 5, "steps": None, "verbose": 0})
    assert callback._steps_left() is None  # pylint: disable=protected-access
    # Restored from a backup at step 6 of epoch 3: Keras' first step is batch 6, and
    # 4 + 10 steps are left; only the fit's first step counts.
    callback.set_params({"epochs": 5, "steps": 10, "verbose": 0})
    callback.on_train_begin()
    callback.on_epoch_begin(3)
    callback.on_train_batch_begin(6)
    assert callback._steps_left() == 14  # pylint: disable=protected-access
    callback.on_train_batch_begin(7)
    assert callback._steps_left() == 14  # pylint: disable=protected-access
    # A new fit starts over.
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    callback.on_train_batch_begin(0)
    assert callback._steps_left() == 50  # pylint: disable=protected-access


def test_the_first_low_rank_measurement_is_the_interval_end_when_they_meet(monkeypatch):
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    cdo = strategy.cross_device_ops
    measured = []
    monkeypatch.setattr(cdo, "measure_low_rank",
                        lambda step_s=None, step_se_s=None, steps_left=None, min_gain_s=0.0,
                        trial_steps=None: measured.append(step_s))
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=4, link_margin=None)
    # The fourth step is both the second of the plan's timed steps and the interval's
    # end, whose adapt measures the low-rank errors: no second measurement, then or
    # later.
    _drive(callback, monkeypatch, [3.0, 1.5, 1.0, 1.0, 1.0, 1.0])
    assert measured == []
    assert len(callback.costs) == 1 and callback.costs[0]["step"] == 4


def test_no_gradient_goes_low_rank_unmeasured_or_on_a_fast_link():
    fig = all_figures(0.1)
    partial = planner.LowRank(2, {"fc1": MEASURED["fc1"]})
    plan = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=partial)
    assert [e.name for e in plan.entries if e.candidate.rank] == ["fc1"]
    # In a critical regime: twice the budget's rank or more (fc1 would take rank 1).
    critical = planner.make_plan(GRADIENTS, fig, 0.05, critical={"fc1"},
                                 low_rank=planner.LowRank(2, MEASURED))
    assert {e.name: e.label for e in critical.entries}["fc1"] == "psgd4", critical.table()
    assert planner.LowRank(8, MEASURED).critical_rank == 8
    # A critical rank given (``auto:critical_rank=``): 8, or none at all, where the
    # default would take 4; the gradients not critical keep the budget's choice.
    for given, allowed in [(8, {"psgd8"}), (0, {"fp32", "bf16"})]:
        rule = planner.LowRank(2, MEASURED, given)
        limited = planner.make_plan(GRADIENTS, fig, 0.05, critical={"fc1"}, low_rank=rule)
        labels = {e.name: e.label for e in limited.entries}
        assert labels["fc1"] in allowed, limited.table()
        free = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=rule)
        assert {e.name: e.label for e in free.entries}["fc1"] == "psgd1", free.table()
    assert planner.LowRank(2, MEASURED, 0).critical_rank is None
    # A critical gradient goes low-rank only where it loses at most ``critical_error``
    # at the rank it takes: fc1 (one direction and a floor) loses less at rank 8 than
    # at 4; between the two errors only rank 8 is left, below both none.
    _, rel = MEASURED["fc1"]
    assert rel[8] < rel[4]
    for limit, allowed in [(1.0, {"psgd4"}), (rel[4], {"psgd4"}),
                           ((rel[4] + rel[8]) / 2, {"psgd8"}), (rel[8] / 2, {"fp32", "bf16"})]:
        rule = planner.LowRank(2, MEASURED, critical_error=limit)
        limited = planner.make_plan(GRADIENTS, fig, 0.05, critical={"fc1"}, low_rank=rule)
        assert {e.name: e.label for e in limited.entries}["fc1"] in allowed, (limit, limited.table())
        free = planner.make_plan(GRADIENTS, fig, 0.05, low_rank=rule)  # not critical: no limit
        assert {e.name: e.label for e in free.entries}["fc1"] == "psgd1", free.table()
    fast = planner.make_plan(GRADIENTS, all_figures(1000.0), 0.05,
                             low_rank=planner.LowRank(2, MEASURED))
    assert {e.label for e in fast.entries} == {"fp32"}
    # Figures without the low-rank timings (a record of an older plan): none either.
    old = planner.make_plan(GRADIENTS, figures(link_gbps=0.1), 0.05,
                            low_rank=planner.LowRank(2, MEASURED))
    assert not any(e.candidate.rank for e in old.entries)


def test_low_rank_sends_both_factors_on_two_rings():
    for label, shape in [("psgd1", (2048, 2048)), ("psgd4", (3, 3, 64, 128)),
                         ("psgd8", (784, 2048))]:
        candidate = planner.BY_LABEL[label]
        rows, cols = candidate.compressor.matrix_shape(tf.TensorShape(shape))
        sent = planner.sent_bytes(candidate, "low_rank", shape, "float32", 4)
        floats = candidate.rank * (rows + cols) + tfgc.distribute.paths.guard.CONTROL_WORDS
        assert sent == int(2 * 3 / 4 * 4 * floats)
        assert planner.path_of(candidate, 4) == "low_rank"


def test_figures_with_the_measured_candidates_timings_round_trip():
    # The layout: the link, the quantizers, the low-rank candidates, then top-k.
    words = list(range(1, len(planner.LINK_SIZES)
                       + 2 * len(planner.CPU_SIZES) * (len(planner.ALL) - 1) + 1))
    fig = planner.Figures.from_words(words, 3)
    assert planner.ALL[-1].label == "topk1"
    assert fig.encode_us["topk1"] == tuple(words[-6::2])
    assert fig.decode_us["psgd8"] == tuple(words[-12 + 1::2][:3])
    assert fig.words() == words
    # Figures from before top-k existed: the low-rank ones still read, top-k missing.
    older = planner.Figures.from_words(words[:-6], 3)
    assert "psgd8" in older.encode_us and "topk1" not in older.encode_us
    assert older.words() == words[:-6]


def test_cpu_timings_leave_out_the_timed_call_s_own_overhead(monkeypatch):
    # A timed call costs a fixed overhead plus its copies' graphs: what a gradient costs
    # inside a step is one copy's graph, with no call of its own.
    def graph_s(n, k):  # one vector's encoding (k 0) or decoding (k 1)
        return (2e-5 + 1e-9 * n, 3e-5 + 2e-9 * n)[k]

    overhead = (4e-4, 3e-4)
    calls = []

    def call_seconds(candidate, n, num_workers, copies, shape=None, repeats=planner.REPEATS):
        calls.append((candidate.label, n, copies))
        # The overhead's calls on the least size, by the vector (or square matrix) of
        # the timings they stand for, more times than the others.
        least = n == planner.CPU_SIZES[0] and shape is None
        assert repeats == (planner.OVERHEAD_REPEATS if least else planner.REPEATS)
        return tuple(overhead[k] + copies * graph_s(n, k) for k in (0, 1))

    def timed(call_seconds):
        monkeypatch.setattr(planner, "_call_seconds", call_seconds)
        planner._least_calls.cache_clear()

    timed(call_seconds)
    try:
        for candidate, copies in ((planner.BY_LABEL["qsgd8"], planner.COPIES),
                                  (planner.BY_LABEL["psgd4"], planner.LOW_RANK_COPIES)):
            for n in planner.CPU_SIZES:
                np.testing.assert_allclose(planner._cpu_seconds(candidate, n, 2),
                                           (graph_s(n, 0), graph_s(n, 1)), rtol=1e-9)
            # The overhead: timed once per candidate, on the least size, at the copies
            # and at twice as many; the first of them is the least size's timing too.
            least = [c[2] for c in calls if c[0] == candidate.label
                     and c[1] == planner.CPU_SIZES[0]]
            assert least == [copies, 2 * copies]
            # A shape of its own (a benchmark's matrices) is timed, not the least size's
            # vector taken for it.
            calls.clear()
            np.testing.assert_allclose(
                planner._cpu_seconds(candidate, planner.CPU_SIZES[0], 2, shape=(64, 64)),
                (graph_s(planner.CPU_SIZES[0], 0), graph_s(planner.CPU_SIZES[0], 1)),
                rtol=1e-9)
            assert calls == [(candidate.label, planner.CPU_SIZES[0], copies)]
        # Noise: twice the copies timed at three times the call is no negative overhead
        # (none taken out); at half the call, the overhead is at most the whole call.
        for factor, want in ((3.0, 0.0), (0.5, 1.0)):
            timed(lambda c, n, w, copies, shape=None, repeats=1, f=factor:
                  (1e-3 * (f if copies == 2 * planner.COPIES else 1.0),) * 2)
            assert planner._call_overhead(planner.BY_LABEL["bf16"], 2) == (want * 1e-3,) * 2
        # A size timed below the overhead costs nothing, not less.
        timed(lambda c, n, w, copies, shape=None, repeats=1:
              (1e-3 if n == planner.CPU_SIZES[0] else 5e-4,) * 2)
        assert planner._call_overhead(planner.BY_LABEL["bf16"], 2) == (1e-3, 1e-3)
        assert planner._cpu_seconds(planner.BY_LABEL["bf16"], planner.CPU_SIZES[1], 2) \
            == (0.0, 0.0)
    finally:
        planner._least_calls.cache_clear()


def test_a_timed_call_s_copies_are_calls_of_one_traced_codec_and_each_runs(monkeypatch):
    # Each copy calls one traced encoding (decoding) with its own index and input; the
    # overhead's two calls on one size share it; and every copy runs: the timed calls
    # return each copy's payload and decoding, each its own input's.
    planner._codec.cache_clear()
    candidate = planner.BY_LABEL["qsgd8"]
    traces = []
    cls = type(candidate.compressor)
    compress, decompress = cls.compress, cls.decompress
    with monkeypatch.context() as m:
        m.setattr(cls, "compress", lambda *a, **k: traces.append("e") or compress(*a, **k))
        m.setattr(cls, "decompress", lambda *a, **k: traces.append("d") or decompress(*a, **k))
        for copies in (4, 8):
            planner._call_seconds(candidate, 1 << 12, 2, copies, repeats=1)
        assert traces == ["e", "d"]
        planner._call_seconds(candidate, 1 << 13, 2, 4, repeats=1)  # another size: traced
        assert traces == ["e", "d"] * 2
    outputs = []
    monkeypatch.setattr(planner, "median_seconds",
                        lambda fn, repeats=planner.REPEATS: outputs.append(fn()[0]) or 1.0)
    n, copies = 1 << 12, 4
    planner._call_seconds(candidate, n, 2, copies)
    encoded, decoded = outputs
    assert len(encoded) == len(decoded) == copies
    inputs = np.stack([tf.random.stateless_normal([n], seed=[7, n + k]).numpy()
                       for k in range(copies)])
    for k, vector in enumerate(decoded):
        # 8-bit QSGD: a relative error near 0.1; two inputs are about 1.4 apart.
        distances = np.linalg.norm(inputs - vector.numpy(), axis=1) / np.linalg.norm(inputs[k])
        assert np.argmin(distances) == k and distances[k] < 0.3, distances


def test_every_candidate_s_codec_is_timed_from_one_trace(monkeypatch):
    # The real encodings and decodings of every candidate, low-rank and top-k too, go
    # through one traced codec: a payload of any of them comes back as its decoding's
    # input, and every timing is a time.
    planner._codec.cache_clear()
    for k, candidate in enumerate(planner.ALL[1:]):
        seconds = planner._call_seconds(candidate, 1 << 12, 2, 2, repeats=1)
        assert all(0 < t < 60 for t in seconds), (candidate.label, seconds)
        assert planner._codec.cache_info().misses == k + 1  # traced: its own codec
    planner._codec.cache_clear()


def test_low_rank_timings_of_two_ranks_and_sizes_give_every_rank_and_size(monkeypatch):
    # Codecs whose seconds are bilinear in elements and rank (fixed cost, per element,
    # per rank, per element and rank): the four timed ones give every other exactly.
    timed = []

    def seconds(candidate, n, num_workers, shape=None):
        timed.append((candidate.rank, n))
        r = candidate.rank
        return (1e-4 + 2e-9 * n + 3e-6 * r + 5e-10 * n * r,
                2e-4 + 1e-9 * n + 1e-6 * r + 7e-10 * n * r)

    monkeypatch.setattr(planner, "_cpu_seconds", seconds)
    monkeypatch.setattr(planner, "_CPU_WORDS", {})
    monkeypatch.setattr(planner, "_COPY_SECONDS", {})
    words = planner._low_rank_words(3)
    ranks, sizes = planner.LOW_RANK_TIMED
    assert sorted(timed) == sorted((r, n) for r in ranks for n in sizes)
    want = [planner._microseconds(t) for c in planner.LOW_RANK for n in planner.CPU_SIZES
            for t in seconds(c, n, 3)]
    np.testing.assert_allclose(words, want, atol=1)
    # The layout the figures read: after the other candidates' words.
    fig = planner.Figures.from_words(
        [1] * (len(planner.LINK_SIZES) + 2 * len(planner.CPU_SIZES) * len(planner.CANDIDATES[1:]))
        + words, 3)
    assert fig.decode_us["psgd2"] == tuple(want[2 * len(planner.CPU_SIZES) + 1::2][:3])
    timed.clear()
    assert planner._low_rank_words(3) == words and not timed  # kept for the process


def test_what_timing_the_measured_candidates_would_cost_is_known_beforehand(monkeypatch,
                                                                            tmp_path, request):
    # Stand-in timed calls on a fake clock that each advances by the vectors it times,
    # encoding and decoding: 30 ms a vector, a low-rank one (a larger graph) 10 ms more
    # than the ``LOW_RANK_COPY_COST`` vectors it counts as. What ``_cpu_seconds`` and
    # ``_least_calls`` make of them is theirs.
    now = [0.0]
    low_rank_s = 0.03 * planner.LOW_RANK_COPY_COST + 0.01

    def call_seconds(candidate, n, num_workers, copies, shape=None, repeats=planner.REPEATS):
        now[0] += 2 * copies * (low_rank_s if candidate.rank else 0.03)
        return 4e-4 + copies * 1e-5, 3e-4 + copies * 2e-5

    monkeypatch.setattr(planner, "_call_seconds", call_seconds)
    monkeypatch.setattr(planner, "time", type("Clock", (), {
        "perf_counter": staticmethod(lambda: now[0])}))
    monkeypatch.setenv(planner.CPU_CACHE_ENV, str(tmp_path / "cpu.json"))

    def new_process():
        monkeypatch.setattr(planner, "_CPU_WORDS", {})
        monkeypatch.setattr(planner, "_COPY_SECONDS", {})
        planner._least_calls.cache_clear()

    request.addfinalizer(planner._least_calls.cache_clear)  # the stand-in's, forgotten
    new_process()
    assert planner.measured_timing_s(4) is None  # nothing timed on this machine yet
    planner._cpu_words(planner.CANDIDATES[1:], 4)
    assert planner._COPY_SECONDS[4] == pytest.approx(0.03)
    # Known from the quantizers' timing: the measured candidates' copies at its cost a
    # copy, short by the 10 ms a low-rank vector costs beyond its count.
    estimate = planner.measured_timing_s(4)
    began = now[0]
    planner._low_rank_words(4)
    planner._cpu_words(planner.SPARSE, 4)
    took = now[0] - began
    low_rank = planner._measured_keys(4)[0][2]
    assert estimate == pytest.approx(took - 0.01 * low_rank / planner.LOW_RANK_COPY_COST)
    assert 0.5 * took < estimate < took
    assert planner.measured_timing_s(4) == 0.0  # timed: nothing left to time
    # The next job on this machine: nothing left to time, all on disk; with the
    # measured candidates' timings gone (a cache of an older tfgc), what a copy cost in
    # the machine's last timing (top-k's, 30 ms) prices them.
    new_process()
    assert planner.measured_timing_s(4) == 0.0
    path = tmp_path / "cpu.json"
    cache = json.loads(path.read_text())
    for key, _, _ in planner._measured_keys(4):
        del cache[planner._disk_key(key)]
    path.write_text(json.dumps(cache))
    new_process()
    (_, _, low_rank), (_, _, top_k) = planner._measured_keys(4)
    assert planner.measured_timing_s(4) == pytest.approx(0.03 * (low_rank + top_k))
    # Figures that hold some of them (a record of an older plan): the others alone.
    assert planner.measured_timing_s(4, all_figures(1.0)) == pytest.approx(0.03 * top_k)
    assert planner.measured_timing_s(4, figures()) == pytest.approx(0.03 * (low_rank + top_k))
    # Without the disk, a new process knows nothing of this machine.
    monkeypatch.setenv(planner.CPU_CACHE_ENV, "0")
    new_process()
    assert planner.measured_timing_s(4) is None
    # Whether a timing may pay: unknown steps or seconds time them.
    assert planner.timing_pays(1e-3, 1000, 1.0) and not planner.timing_pays(1e-3, 999, 1.0)
    for steps_left, timing_s in ((None, 1e9), (float("nan"), 1e9), (1, None), (1, math.nan)):
        assert planner.timing_pays(0.0, steps_left, timing_s)


def test_candidates_whose_timing_cannot_pay_are_left_untimed_until_it_can(monkeypatch):
    ops, auto = _tracking_planner()
    fig = figures(link_gbps=1.0)  # the quantizers timed, not the measured candidates
    timed_fig = with_top_k(all_figures(1.0))
    assert not planner.measured(fig) and not planner.measured(all_figures(1.0))
    assert planner.measured(timed_fig)
    current = planner.make_plan(GRADIENTS, fig, 0.05)
    lay = _timed_layout(ops, auto, fig, current, [])
    lay.matrices = [0, 1, 2]  # embed, fc1, fc2
    timed = []
    monkeypatch.setattr(planner, "measure_low_rank", lambda o, f: timed.append(f) or f)
    monkeypatch.setattr(auto, "_measure_low_rank", lambda lay: {})
    # At most what the matrices cost now, at the most the pace scales the predicted
    # communication by (none measured yet); on a measured link, no more than the step
    # (a given link is not the one the step ran on).
    cost = sum(e.cpu_s + e.wire_s for e in current.entries if e.name in ("embed", "fc1", "fc2"))
    saving = cost * planner.PACE_SCALE[1]
    assert 0 < cost < predicted_seconds(current)
    assert auto._saving_bound([lay], 10.0) == pytest.approx(saving)
    assert auto._saving_bound([lay], saving / 2) == pytest.approx(saving)
    auto._figures = (ops.generation, dataclasses.replace(fig, link_gbps=0.0))
    assert auto._saving_bound([lay], saving / 2) == pytest.approx(saving / 2)
    assert auto._saving_bound([lay], 10.0) == pytest.approx(saving)
    auto._figures = (ops.generation, fig)
    # A measured pace scales the predicted communication as the steps did.
    lay.plan = (ops.generation, dataclasses.replace(current, pace=planner.Pace(0.01, 0.5)))
    assert auto._saving_bound([lay], 10.0) == pytest.approx(cost * 0.5)
    lay.plan = (ops.generation, current)
    steps = 100
    assert not auto._measured([lay], 10.0, steps, 1.01 * saving * steps)
    assert not timed and ops.low_rank_untimed() == auto.untimed
    assert "untimed" in auto.untimed and f"{steps} steps left" in auto.untimed
    # Timing that pays, or whose steps or seconds are unknown: timed (and said no more).
    for steps_left, timing_s in ((steps, 0.99 * saving * steps), (math.nan, 1e9),
                                 (steps, math.nan)):
        timed.clear()
        auto._measured([lay], 10.0, steps_left, timing_s)
        assert timed and auto.untimed is None
    # Figures with their timings: nothing to time, whatever is left.
    lay.plan = (ops.generation, planner.make_plan(GRADIENTS, timed_fig, 0.05))
    auto._figures = (ops.generation, timed_fig)
    timed.clear()
    auto._measured([lay], 10.0, 0, 1e9)
    assert timed and auto.untimed is None


def test_a_timing_must_pay_for_the_change_it_would_lead_to(monkeypatch):
    # What the measured candidates could save a step is less what a change of plan must
    # save to pay for its retrace: twice the least gain before the steps measured a
    # slope (the change, and the way back), once after.
    ops, auto = _tracking_planner()
    fig = figures(link_gbps=1.0)
    current = planner.make_plan(GRADIENTS, fig, 0.05)
    lay = _timed_layout(ops, auto, fig, current, [])
    lay.matrices = [0, 1, 2]
    timed = []
    monkeypatch.setattr(planner, "measure_low_rank", lambda o, f: timed.append(f) or f)
    monkeypatch.setattr(auto, "_measure_low_rank", lambda lay: {})
    saving, steps = auto._saving_bound([lay], 10.0), 100
    gain = saving / 4
    assert not current.slope_measured
    # Without a change's price it would pay; with it, (saving - 2 gain) falls short.
    timing_s = 0.75 * saving * steps
    assert planner.timing_pays(saving, steps, timing_s)
    assert not auto._measured([lay], 10.0, steps, timing_s, min_gain_s=gain)
    assert not timed and f"{2 * gain * 1e3:.2f} ms of which a change" in auto.untimed
    auto._measured([lay], 10.0, steps, 0.45 * saving * steps, min_gain_s=gain)
    assert timed and auto.untimed is None
    # Once the steps measured the pace's slope, a change pays for itself alone.
    timed.clear()
    measured = planner.Pace(0.01, 1.0, others=(planner.Pace(0.01, 0.9), planner.Pace(0.01, 1.1)))
    lay.plan = (ops.generation, dataclasses.replace(current, pace=measured))
    assert lay.plan[1].slope_measured
    saving = auto._saving_bound([lay], 10.0)
    auto._measured([lay], 10.0, steps, 0.7 * saving * steps, min_gain_s=saving / 4)
    assert timed
    # A least gain beyond the saving: never timed (unless it costs nothing: kept on disk).
    timed.clear()
    assert not auto._measured([lay], 10.0, steps, 1e-3, min_gain_s=2 * saving)
    assert not timed
    auto._measured([lay], 10.0, steps, 0.0, min_gain_s=2 * saving)
    assert timed


def test_the_low_rank_measurement_asks_worker_0s_least_gain_of_a_new_plan(monkeypatch):
    # ``measure_low_rank``'s least gain reaches the decision as worker 0 gave it, beside
    # the step and the steps left (one all-gather of them all).
    ops, auto = _tracking_planner()
    fig = figures(link_gbps=1.0)
    lay = _timed_layout(ops, auto, fig, planner.make_plan(GRADIENTS, fig, 0.05), [])
    lay.summed = tf.Variable(1.0)  # worker 0 summed a step of it: it trains
    asked = []
    monkeypatch.setattr(auto, "_measured", lambda ran, step_s, steps_left, timing_s,
                        min_gain_s: asked.append((step_s, steps_left, min_gain_s)) or True)
    monkeypatch.setattr(auto, "_decide", lambda ran, min_gain_s=0.0, trial_share=0.0:
                        asked.append((min_gain_s, trial_share)) or {})
    monkeypatch.setattr(auto, "_take", lambda plans, figures: False)
    ops.measure_low_rank(step_s=0.5, steps_left=300, min_gain_s=0.25, trial_steps=30)
    # A trial's 30 steps are a tenth of the 300 a change pays over.
    assert asked == [(0.5, 300.0, 0.25), (0.25, pytest.approx(0.1))]
    asked.clear()
    ops.measure_low_rank(step_s=0.5, steps_left=None, min_gain_s=0.25, trial_steps=30)
    assert asked[-1] == (0.25, 1.0)  # a fit of unknown length: over the trial's own
    with pytest.raises(ValueError, match="trial_steps"):
        ops.measure_low_rank(step_s=0.5, trial_steps=-1)


def test_the_steps_left_and_the_timings_cost_decide_whether_low_rank_is_timed(monkeypatch,
                                                                             tmp_path):
    # Through ``measure_low_rank``: every worker's words gathered (worker 0's steps,
    # the most seconds), then the decision, on a machine whose cache lacks the measured
    # candidates and whose last timing cost a second a copy.
    ops, auto = _tracking_planner()
    fig = figures(link_gbps=1.0)
    lay = _timed_layout(ops, auto, fig, planner.make_plan(GRADIENTS, fig, 0.05), [])
    lay.matrices = [0, 1, 2]
    lay.summed = tf.Variable(1.0)  # worker 0 summed a step of it: it trains
    monkeypatch.setenv(planner.CPU_CACHE_ENV, str(tmp_path / "cpu.json"))
    monkeypatch.setattr(planner, "_CPU_WORDS", {})
    monkeypatch.setattr(planner, "_COPY_SECONDS", {4: 1.0})
    timed = []
    monkeypatch.setattr(planner, "measure_low_rank", lambda o, f: timed.append(f) or f)
    monkeypatch.setattr(auto, "_measure_low_rank", lambda lay: {})
    cost = planner.measured_timing_s(4)
    steps = cost / auto._saving_bound([lay], 10.0)  # the fewest over which it pays
    assert cost == sum(c for _, _, c in planner._measured_keys(4)) and steps > 10
    # Keras' counts may be NumPy's.
    assert ops.measure_low_rank(step_s=10.0, steps_left=np.int64(0.9 * steps)) is False
    note = ops.low_rank_untimed()
    assert not timed and "untimed" in note
    # An interval's end asks again (and restarts the step counts: another step); the
    # line logged the first time stays.
    assert ops.adapt(0.5, step_s=10.0, steps_left=int(0.8 * steps)) is not None
    assert not timed and ops.low_rank_untimed() == note
    lay.summed.assign(1.0)
    ops.measure_low_rank(step_s=10.0, steps_left=int(1.1 * steps))
    assert timed and ops.low_rank_untimed() is None
    timed.clear()
    lay.summed.assign(1.0)
    ops.measure_low_rank(step_s=10.0)  # the fit's length unknown: timed
    assert timed


def test_cpu_timings_are_kept_on_disk_for_the_next_job_on_this_machine(monkeypatch, tmp_path):
    # Stand-in codecs whose seconds grow with the elements; a new process is a cleared
    # ``_CPU_WORDS``.
    timed = []

    def seconds(candidate, n, num_workers, shape=None):
        timed.append((candidate.label, n))
        return 1e-4 + 2e-9 * n, 2e-4 + 1e-9 * n

    monkeypatch.setattr(planner, "_cpu_seconds", seconds)
    monkeypatch.setenv("TFGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(planner.CPU_CACHE_ENV, "1")

    def new_process():
        monkeypatch.setattr(planner, "_CPU_WORDS", {})
        monkeypatch.setattr(planner, "_COPY_SECONDS", {})
        timed.clear()

    new_process()
    first = planner._cpu_words(planner.CANDIDATES[1:], 4)
    assert len(timed) == len(planner.CANDIDATES[1:]) * len(planner.CPU_SIZES)
    assert planner.cpu_cache_path() == str(tmp_path / "auto" / "cpu.json")
    low_rank = planner._low_rank_words(4)
    # The next job: the same words, nothing timed, for both kinds.
    new_process()
    assert planner._cpu_words(planner.CANDIDATES[1:], 4) == first
    assert planner._low_rank_words(4) == low_rank
    assert not timed
    # Another cluster size, other candidates or another tfgc: timed.
    for change in (lambda: planner._cpu_words(planner.CANDIDATES[1:], 3),
                   lambda: planner._cpu_words(planner.CANDIDATES[1:3], 4)):
        new_process()
        change()
        assert timed
    new_process()
    monkeypatch.setattr(tfgc, "__version__", tfgc.__version__ + ".dev")
    planner._cpu_words(planner.CANDIDATES[1:], 4)
    assert timed
    monkeypatch.undo()
    monkeypatch.setattr(planner, "_cpu_seconds", seconds)
    monkeypatch.setenv("TFGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(planner.CPU_CACHE_ENV, "1")
    # A damaged file, or a damaged entry, is timed again and written anew.
    for damage in ("{not json", json.dumps({planner._disk_key(
            (4, tuple(c.label for c in planner.CANDIDATES[1:]))): [1, 2, "x"]})):
        (tmp_path / "auto" / "cpu.json").write_text(damage)
        new_process()
        assert planner._cpu_words(planner.CANDIDATES[1:], 4) == first and timed
        new_process()
        assert planner._cpu_words(planner.CANDIDATES[1:], 4) == first and not timed
    # Turned off: nothing read (timed again) and nothing written.
    monkeypatch.setenv(planner.CPU_CACHE_ENV, "0")
    (tmp_path / "auto" / "cpu.json").unlink()
    new_process()
    planner._cpu_words(planner.CANDIDATES[1:], 4)
    assert timed and not (tmp_path / "auto" / "cpu.json").exists()
    # A file named: kept there, read back by the next job, the cache root untouched.
    named = tmp_path / "elsewhere" / "timings.json"
    monkeypatch.setenv(planner.CPU_CACHE_ENV, str(named))
    assert planner.cpu_cache_path() == str(named)
    new_process()
    assert planner._cpu_words(planner.CANDIDATES[1:], 4) == first and timed
    assert named.exists() and not (tmp_path / "auto" / "cpu.json").exists()
    new_process()
    assert planner._cpu_words(planner.CANDIDATES[1:], 4) == first and not timed
    # A bare file name is a file in the working directory, not the default silently.
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv(planner.CPU_CACHE_ENV, "timings.json")
    assert planner.cpu_cache_path() == str(named)
    monkeypatch.setenv(planner.CPU_CACHE_ENV, "mine.json")
    new_process()
    planner._cpu_words(planner.CANDIDATES[1:], 4)
    assert timed and (tmp_path / "elsewhere" / "mine.json").exists()
    assert not (tmp_path / "auto" / "cpu.json").exists()


def test_a_rank_change_keeps_the_residual_and_draws_a_new_query():
    # What auto relies on when a plan moves a gradient to another rank: the state's
    # migration carries the residual (same shape) and starts the query afresh. After
    # a step of rank 2, a zero gradient at rank 4 sends the residual itself: what goes
    # out plus what stays is exactly the residual carried over.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(
        "powersgd:rank=2", policy=tfgc.CompressionPolicy(min_elements=0))
    with strategy.scope():
        var = tf.Variable(tf.zeros([48, 32]))
    owner = tf.Module()

    def make_step():
        @tf.function
        def step(g):
            def replica_fn(g):
                with tfgc.compress_gradients([var], owner=owner):
                    return tf.distribute.get_replica_context().all_reduce("sum", [g * 1.0])
            return strategy.run(replica_fn, args=(g,))
        return step

    g = tf.random.stateless_normal([48, 32], seed=[3, 4])
    make_step()(g)
    state = tfgc.distribute.state.get_state(owner)
    residual = state.slot(var, 0)["residual"].numpy()
    assert np.sum(residual ** 2) > 0.1 * np.sum(g.numpy() ** 2)  # rank 2 of 32 leaves much
    strategy.compressor = "powersgd:rank=4"
    out = make_step()(tf.zeros([48, 32]))[0]
    out = strategy.experimental_local_results(out)[0].numpy()
    slot = state.slot(var, 0)
    assert slot["query"].shape == (32, 4)
    np.testing.assert_allclose(out + slot["residual"].numpy(), residual, atol=1e-5)
    assert np.sum(out ** 2) > 0.1 * np.sum(residual ** 2)


# -- the candidates' bounds -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["heavy", "spikes", "equal"])
@pytest.mark.parametrize("label", [c.label for c in planner.CANDIDATES[1:]])
def test_each_candidates_error_stays_within_the_bound_the_budget_uses(label, kind):
    candidate = planner.BY_LABEL[label]
    compressor = candidate.compressor
    shape = tf.TensorShape([300, 70])
    rng = np.random.default_rng(0)
    if kind == "heavy":  # heavy-tailed values, as gradients are
        values = rng.standard_t(3, size=shape.as_list())
    elif kind == "spikes":  # one large element per 128 (the max-normed levels' worst)
        values = rng.normal(size=shape.as_list()) * 1e-3
        values.reshape(-1)[::128] = 1.0
    else:  # every element alike (the l2-normed levels' worst)
        values = np.ones(shape.as_list())
    g = tf.constant(values.astype(np.float32))
    errors = []
    for step in range(20):
        ctx = tfgc.compressors.CompressContext(step=tf.constant(step, tf.int64))
        payload, _ = compressor.compress(g, {}, ctx)
        out = compressor.decompress(payload, shape, tf.float32, ctx)
        errors.append(float(tf.reduce_sum((out - g) ** 2) / tf.reduce_sum(g ** 2)))
    bound = candidate.variance_bound(shape.num_elements())
    assert np.mean(errors) <= bound
    if label == "bf16":
        # Round to nearest with 8 significant bits: each element within 2**-8 of itself.
        out = compressor.decompress(compressor.compress(g, {}, ctx)[0], shape, tf.float32, ctx)
        assert np.all(np.abs(out - g) <= 2.0 ** -8 * np.abs(g))


# -- settings ----------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["auto", "auto:low_rank=0", "auto:low_rank=8",
                                  "auto:error=0.07,link_gbps=1.5,low_rank_steps=0.5",
                                  "auto:link_gbps=10,latency_ms=0.02",
                                  "auto:critical_rank=8", "auto:critical_rank=0",
                                  "auto:low_rank=4,critical_rank=4",
                                  "auto:low_rank=0,critical_rank=0",
                                  "auto:critical_error=0.2", "auto:critical_error=inf"])
def test_the_settings_round_trip_through_their_spec_and_config(spec):
    # Every argument comes back as given, low_rank included (kept as budget_rank): the
    # workers compare serialized settings, and logs and results print them.
    from tfgc.compressors import registry
    from tfgc.compressors.auto import Auto

    auto = get_compressor(spec)
    assert get_compressor(registry.serialize(auto)) == auto
    assert Auto(**auto.get_config()) == auto
    assert auto.get_config()["low_rank"] == auto.budget_rank
    assert auto.low_rank is None  # not a compressor that sends low-rank factors itself
    assert get_compressor(registry.describe(auto)) == auto
    others = [get_compressor(f"auto:low_rank={r}") for r in (0, 1, 2, 4, 8)]
    assert sum(other == auto for other in others) == (
        1 if auto.error == 0.05 and not auto.link_gbps and auto.critical_rank is None
        and auto.critical_error == 0.05 else 0)
    # A critical rank given is kept apart from the default's, even where they agree
    # (twice low_rank=4 is 8): the spec says what the user wrote.
    assert ("critical_rank" in auto.get_config()) == ("critical_rank" in spec)


@pytest.mark.parametrize("spec, argument", [
    ("auto:error=-1", "error"), ("auto:link_gbps=-2", "link_gbps"),
    ("auto:link_gbps=1,latency_ms=0", "latency_ms"), ("auto:error=fast", "error"),
    # A latency is the given link's: without one, the probe measures it.
    ("auto:latency_ms=5", "latency_ms"),
    ("auto:budget=1", "budget"), ("auto:low_rank=3", "low_rank"),
    ("auto:low_rank=-1", "low_rank"), ("auto:low_rank_steps=-0.1", "low_rank_steps"),
    ("auto:low_rank_steps=inf", "low_rank_steps"),
    ("auto:critical_rank=3", "critical_rank"), ("auto:critical_rank=true", "critical_rank"),
    ("auto:critical_rank=-1", "critical_rank"), ("auto:critical_error=-0.1", "critical_error"),
    # A rank is an integer, as every compressor's integer settings are.
    ("auto:critical_rank=4.0", "critical_rank"), ("auto:low_rank=2.0", "low_rank"),
    ("auto:critical_error=nan", "critical_error"), ("auto:critical_error=fast", "critical_error"),
    # Below the budget's rank: a critical gradient would lose more than the others.
    ("auto:low_rank=4,critical_rank=2", "critical_rank"),
    # Nothing goes low-rank at all (critical_rank=0 agrees with that, and is taken).
    ("auto:low_rank=0,critical_rank=8", "critical_rank"),
    ("auto:low_rank=0,critical_error=0.3", "critical_error")])
def test_bad_settings_fail_at_construction_naming_the_argument(spec, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        tfgc.CompressedMultiWorkerMirroredStrategy(compressor=spec)


def test_the_plan_callback_refuses_what_it_cannot_use():
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="qsgd")
    with pytest.raises(ValueError, match="needs compressor='auto'"):
        tfgc.keras.AutoPlanCallback(strategy)
    with pytest.raises(ValueError, match="is for compressor='auto'"):
        strategy.cross_device_ops.replan()
    with pytest.raises(ValueError, match="is for compressor='auto'"):
        strategy.cross_device_ops.pin_plan("bf16")
    strategy.compressor = "auto"
    for kwargs, argument in [({"threshold": 0}, "threshold"), ({"link_margin": -1}, "link_margin"),
                             ({"every_epochs": 0}, "every_epochs"),
                             ({"every_steps": 0}, "every_steps"),
                             ({"every_steps": 2.5}, "every_steps"),
                             ({"link_share": 0}, "link_share"),
                             ({"link_share": 1.5}, "link_share")]:
        with pytest.raises(ValueError, match=f"`{argument}`"):
            tfgc.keras.AutoPlanCallback(strategy, **kwargs)
    # Counts as NumPy's, as a script may compute them.
    assert tfgc.keras.AutoPlanCallback(strategy, every_steps=np.int64(20))._every_steps == 20  # pylint: disable=protected-access
    with pytest.raises(ValueError, match="needs track_regimes"):
        strategy.cross_device_ops.adapt()
    for step_s in (0.0, -1.0, float("inf"), "fast"):
        with pytest.raises(ValueError, match="`step_s`"):
            strategy.cross_device_ops.adapt(step_s=step_s)
        with pytest.raises(ValueError, match="`step_s`"):
            strategy.cross_device_ops.measure_low_rank(step_s=step_s)
    for step_se_s in (-1.0, float("nan"), float("inf"), "fast", True):
        with pytest.raises(ValueError, match="`step_se_s`"):
            strategy.cross_device_ops.adapt(step_s=0.05, step_se_s=step_se_s)
        with pytest.raises(ValueError, match="`step_se_s`"):
            strategy.cross_device_ops.measure_low_rank(step_s=0.05, step_se_s=step_se_s)
    for steps_left in (-1, "many", True, float("nan")):
        with pytest.raises(ValueError, match="`steps_left`"):
            strategy.cross_device_ops.adapt(steps_left=steps_left)
        with pytest.raises(ValueError, match="`steps_left`"):
            strategy.cross_device_ops.measure_low_rank(steps_left=steps_left)
    for min_gain_s in (-1.0, float("nan"), "some"):
        with pytest.raises(ValueError, match="`min_gain_s`"):
            strategy.cross_device_ops.measure_low_rank(min_gain_s=min_gain_s)
    # Tracked, but nothing planned (a model whose gradients the policy all sends dense):
    # an interval ends with no regime, rather than stopping the fit.
    strategy.cross_device_ops.track_regimes()
    assert strategy.cross_device_ops.adapt() == frozenset()
    assert strategy.cross_device_ops.measure_low_rank() is False


def small_model(strategy, width=64, outputs=4, prefix=""):
    """A compiled 40-``width``-``outputs`` model under ``strategy``: one kernel large enough
    for the policy to plan (``width`` >= 26), the rest sent dense; its layers are
    ``prefix`` + "a" and "b"."""
    import tf_keras as keras
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(width, input_shape=(40,),
                                                     name=prefix + "a"),
                                  keras.layers.Dense(outputs, name=prefix + "b")])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def small_data(rows, outputs=4):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(rows, 40)).astype(np.float32),
            rng.normal(size=(rows, outputs)).astype(np.float32))


def test_the_plan_callback_ends_an_interval_every_so_many_steps():
    # One worker (nothing to compress, but the intervals run as on a cluster): 12 steps
    # in three epochs, intervals of 5 steps end after steps 5 and 10.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    model = small_model(strategy)
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=5, link_margin=None)
    model.fit(*small_data(32), batch_size=8, epochs=3, verbose=0, callbacks=[callback])
    # 4 steps per epoch: steps 5 and 10 are in epochs 1 and 2, and no epoch's end counts.
    assert [epoch for epoch, _, _ in callback.history] == [1, 2]
    # The first interval has no previous one: every planned gradient critical.
    names = [e.name for e in strategy.compression_plan().entries]
    assert callback.history[0][1] == sorted(names)


def test_a_learning_rate_that_falls_by_the_threshold_makes_every_gradient_critical():
    # The same 8 rows every step at a small rate: the interval sums' norms barely move,
    # so after the first interval only the learning rate's fall makes a regime.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    cdo = strategy.cross_device_ops
    cdo.track_regimes()
    model = small_model(strategy)
    x, y = (np.tile(a, (2, 1)) for a in small_data(8))
    names = None
    for rate, want in [(0.1, "all"), (0.1, "none"), (0.06, "none"), (0.03, "all"),
                       (None, "none"), (0.01, "none"), (0.1, "none"), (0.0, "all")]:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        names = names or frozenset(e.name for e in strategy.compression_plan().entries)
        assert names
        # 0.1 -> 0.06 fell by 40 %, 0.06 -> 0.03 by half; None leaves the rate unknown,
        # so the next one has nothing to compare with; a rise is not a fall.
        assert cdo.adapt(0.5, learning_rate=rate) == (names if want == "all" else frozenset())
    # After the fall, each gradient is held at what it went as (one worker: float32);
    # the last rate and the holds are kept with the regimes, and read back from a
    # checkpoint's record.
    lay, = cdo._auto._layouts.values()  # pylint: disable=protected-access
    assert lay.held == {"a/kernel:0": "fp32"}
    part = cdo._auto.snapshot()["layouts"][0]  # pylint: disable=protected-access
    assert part["learning_rate"] == 0.0 and part["held"] == {"a/kernel:0": "fp32"}
    lay.learning_rate, lay.held = None, {}
    autoplan.AutoPlanner._take_part(lay, json.loads(json.dumps(part)))  # pylint: disable=protected-access
    assert lay.learning_rate == 0.0 and lay.held == {"a/kernel:0": "fp32"}
    part["held"] = {"a/kernel:0": "psgd8", "b/kernel:0": "psgd99", "c": 8}
    autoplan.AutoPlanner._take_part(lay, part)  # pylint: disable=protected-access
    assert lay.held == {"a/kernel:0": "psgd8"}  # labels this version does not know: none
    del part["learning_rate"], part["held"]  # a record from before they were kept
    autoplan.AutoPlanner._take_part(lay, part)  # pylint: disable=protected-access
    assert lay.learning_rate is None and lay.held == {}
    # The next interval without a fall holds nothing; after a fall under a low-rank
    # plan (pinned here: one worker plans float32), the hold is that plan's label.
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    cdo.adapt(0.5, learning_rate=0.0)
    assert lay.held == {}
    cdo.adapt(0.5, learning_rate=0.1)  # no step since: the layout did not train
    assert cdo.pin_plan({"a/kernel:0": "psgd2"})
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    cdo.adapt(0.5, learning_rate=0.5)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert cdo.adapt(0.5, learning_rate=0.1) == names
    assert lay.held == {"a/kernel:0": "psgd2"}
    for bad in (-0.1, float("nan"), "fast", True):
        with pytest.raises(ValueError, match="`learning_rate`"):
            cdo.adapt(0.5, learning_rate=bad)


@pytest.mark.parametrize("watch", [True, False])
def test_the_plan_callback_reads_the_optimizers_scheduled_rate(watch):
    # A step decay after step 10, intervals of 5 steps: the interval that ends at step
    # 15 follows the decay, and only a watching callback makes every gradient critical.
    # The same rows every step keep the norms still, so nothing else does.
    import tf_keras as keras
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(64, input_shape=(40,), name="a"),
                                  keras.layers.Dense(4, name="b")])
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay([10], [0.01, 0.001])
        model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=5, link_margin=None,
                                           watch_learning_rate=watch)
    model.fit(*small_data(8), batch_size=8, epochs=20, shuffle=False, verbose=0,
              callbacks=[callback])
    names = sorted(e.name for e in strategy.compression_plan().entries)
    assert names
    assert [critical for _, critical, _ in callback.history] == \
        [names, [], names if watch else [], []]


def test_the_plan_callback_reads_the_rate_of_optimizers_users_bring(caplog):
    # The rate the next step takes: after 3 steps, a schedule's value at step 3 (tf-keras'
    # own ``learning_rate`` holds the last step's, at step 2), through loss scaling and
    # the legacy optimizers too; a rate that cannot be read is None, said once.
    import tf_keras as keras
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    callback = tfgc.keras.AutoPlanCallback(strategy)
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 10)
    x, y = np.ones((12, 3), np.float32), np.ones((12, 2), np.float32)
    for optimizer, want in [
            (keras.optimizers.SGD(0.2), 0.2),
            (keras.optimizers.SGD(schedule), float(schedule(3))),
            (keras.optimizers.legacy.SGD(schedule), float(schedule(3))),
            (keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(schedule)),
             float(schedule(3)))]:
        model = keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=4, verbose=0)
        callback.set_model(model)
        assert callback._learning_rate() == pytest.approx(want), optimizer  # pylint: disable=protected-access

    class Broken(keras.optimizers.schedules.LearningRateSchedule):
        fail = False  # the optimizer reads it once when made

        def __call__(self, step):
            if self.fail:
                raise RuntimeError("no rate here")
            return 0.1

    model.optimizer = None
    assert callback._learning_rate() is None  # pylint: disable=protected-access
    broken = Broken()
    model.optimizer = keras.optimizers.SGD(broken)
    broken.fail = True
    with caplog.at_level(logging.WARNING):
        assert callback._learning_rate() is None  # pylint: disable=protected-access
        assert callback._learning_rate() is None  # pylint: disable=protected-access
    assert sum("could not read the optimizer's learning rate" in r.getMessage()
               for r in caplog.records) == 1
    with pytest.raises(ValueError, match="`watch_learning_rate`"):
        tfgc.keras.AutoPlanCallback(strategy, watch_learning_rate="yes")
    off = tfgc.keras.AutoPlanCallback(strategy, watch_learning_rate=False)
    off.set_model(model)
    model.optimizer = keras.optimizers.SGD(0.2)
    assert off._learning_rate() is None  # pylint: disable=protected-access


def test_an_interval_whose_every_step_was_skipped_keeps_the_regimes_it_had():
    # A non-finite gradient skips the step (nothing summed): an interval of such steps
    # says nothing of the regimes, so the gradients stay as critical as they were, and
    # adapt says so (it returned no critical name, while the plan still followed them).
    # A model not trained in the interval is not reported (another fit's, before it).
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    cdo = strategy.cross_device_ops
    cdo.track_regimes()
    model = small_model(strategy)
    x, y = small_data(16)
    model.fit(x, y, batch_size=4, steps_per_epoch=2, verbose=0)
    names = frozenset(e.name for e in strategy.compression_plan().entries)
    assert names and cdo.adapt(0.5) == names  # no previous interval: all critical
    model.fit(np.full_like(x, np.nan), y, batch_size=4, steps_per_epoch=2, verbose=0)
    assert cdo.adapt(0.5) == names
    other = small_model(strategy, 48, prefix="other_")
    cdo.track_regimes()  # the next fit
    other.fit(x, y, batch_size=4, steps_per_epoch=2, verbose=0)
    assert cdo.adapt(0.5) == {"other_a/kernel:0"}


def test_a_step_of_more_sets_than_the_planner_keeps_keeps_them_all():
    # One train_step applying five optimizers: five sets of gradients a step, one more
    # than autoplan.MAX_LAYOUTS. Each retrace evicted the set it was about to need, so
    # every set was planned afresh at every retrace, its regimes gone, and one was
    # missing from compression_plans(). Now the sets a train function reduces stay.
    import tf_keras as keras

    sets = autoplan.MAX_LAYOUTS + 1
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    auto = strategy.cross_device_ops._auto  # pylint: disable=protected-access

    class Several(keras.Model):
        def __init__(self):
            super().__init__()
            self.nets = [keras.layers.Dense(32 + i, name=f"net{i}") for i in range(sets)]
            self.opts = [keras.optimizers.SGD(0.01) for _ in range(sets)]

        def train_step(self, data):
            x, y = data
            for net, opt in zip(self.nets, self.opts):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(net(x)[:, :4] - y))
                opt.apply_gradients(zip(tape.gradient(loss, net.trainable_variables),
                                        net.trainable_variables))
            return {"loss": loss}

    with strategy.scope():
        model = Several()
        model.compile()
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=2, link_margin=None)
    model.fit(*small_data(32), batch_size=4, epochs=1, steps_per_epoch=6, verbose=0,
              callbacks=[callback])
    plans = strategy.compression_plans()
    assert [[e.name for e in plan.entries] for plan in plans] == [
        [f"net{i}/kernel:0"] for i in range(sets)]
    # Made once each (track_regimes' retrace and every interval's found them).
    layouts = auto._layouts.values()  # pylint: disable=protected-access
    assert sorted(layout.number for layout in layouts) == list(range(sets))


def fit_bag(strategy, steps, callbacks=()):
    """The cluster's bag of embeddings (``worker.build_bag``: a head below the policy's
    1024 elements) fitted ``steps`` steps of 8 rows under ``strategy``; its history."""
    model = worker.build_bag(strategy)
    rng = np.random.default_rng(0)
    x = rng.integers(0, worker.BAG_TABLE[0], (8 * steps, worker.BAG_TOKENS)).astype(np.int32)
    return model.fit(x, (x[:, 0] % 4).astype(np.int32), batch_size=8, epochs=1, verbose=0,
                     callbacks=list(callbacks))


def test_a_bag_of_embeddings_under_a_small_head_is_planned():
    # The table is the only gradient large enough to plan (the head's kernel is below
    # the policy's 1024 elements). Its rows went on the stock gather as float32, with
    # no plan at all (compression_plans() empty): the planner ran only where some other
    # gradient was planned.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=3, link_margin=None)
    history = fit_bag(strategy, 12, [callback])
    (plan,) = strategy.compression_plans()
    assert plan.entries == () or [e.name for e in plan.entries] == ["bag/embeddings:0"]
    (table,) = plan.tables
    assert table.name == "bag/embeddings:0" and table.rows > 0  # counted since
    # On one worker nothing travels: the rows go float32 (encoding them would cost
    # CPU for nothing), and say so. A cluster's plan compresses them:
    # test_a_bag_of_embeddings_is_planned_on_every_worker_alike.
    assert table.label == "fp32" and not table.dense
    assert [u["reason"] for u in strategy.uncompressed_gradients()
            if u["variable"].startswith("bag")] == [
                "auto's plan: float32, embedding rows on the stock gather"]
    stats = strategy.compression_stats()
    assert stats["steps"] == 12 and stats["nonfinite_steps"] == 0
    assert np.all(np.isfinite(history.history["loss"]))
    assert len(callback.history) == 4


def test_a_plan_of_tables_alone_comes_back_from_its_record_as_saved():
    # A plan with no entries (the table alone) has no labels to restore ({}): the
    # restore took that for no saved plan and planned afresh, dropping what the rows
    # went as (a plan kept because a change did not pay would come back changed).
    first = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    fit_bag(first, 2)
    record = first.cross_device_ops._auto.snapshot()  # pylint: disable=protected-access
    (part,) = record["layouts"]
    assert part["labels"] == {} and part["tables"][0][6] == "fp32", part  # one worker
    for label in ("bf16", "rqsgd8"):  # each unlike the plan made afresh
        part["tables"][0][6] = label
        part["key"] = f"auto:bag/embeddings:0=rows:{label}"
        again = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
        again.cross_device_ops._auto.restored(json.loads(json.dumps(record)))  # pylint: disable=protected-access
        fit_bag(again, 1)
        assert [p.key() for p in again.compression_plans()] == [part["key"]]
        assert again.cross_device_ops._auto.measurements == 0  # pylint: disable=protected-access


def test_a_model_not_trained_in_an_interval_keeps_its_timed_steps():
    # Two models fitted in turn under AutoPlanCallback, the first leaving a step after
    # its last interval: that step made it count as trained in the second model's
    # intervals, whose steps were then timed as its own. Each fit now starts counting
    # afresh (the callback's track_regimes at its start).
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    auto = strategy.cross_device_ops._auto  # pylint: disable=protected-access

    def fit(width, steps):
        model = small_model(strategy, width)
        callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=4, link_margin=None)
        model.fit(*small_data(40), batch_size=4, epochs=1, steps_per_epoch=steps,
                  verbose=0, callbacks=[callback])

    fit(64, 5)  # an interval ends at step 4; step 5 is left over
    (first,) = auto._layouts.values()  # pylint: disable=protected-access
    timed = dict(first.steps)
    fit(48, 8)  # intervals end at steps 4 and 8, with ordinary steps timed
    assert len(auto._layouts) == 2  # pylint: disable=protected-access
    assert first.steps == timed


def test_models_fitted_one_after_another_are_forgotten_beyond_the_bound():
    # A sweep: a new model each trial under one strategy. The planner keeps the last
    # MAX_LAYOUTS of them (and with them worker 0's interval sums), not every one.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    auto = strategy.cross_device_ops._auto  # pylint: disable=protected-access
    strategy.cross_device_ops.track_regimes()
    widths = [64 + trial for trial in range(autoplan.MAX_LAYOUTS + 3)]
    for width in widths:
        small_model(strategy, width).fit(*small_data(16), batch_size=4, steps_per_epoch=2,
                                         verbose=0)
        strategy.cross_device_ops.adapt(0.5, step_s=0.1)
    layouts = list(auto._layouts.values())  # pylint: disable=protected-access
    assert [layout.gradients[0][1] for layout in layouts] == [
        (40, width) for width in widths[-autoplan.MAX_LAYOUTS:]]
    assert len(auto.snapshot()["layouts"]) == autoplan.MAX_LAYOUTS


@pytest.mark.parametrize("per_call,ends", [(2, [6, 10]), (3, [6, 12])])
def test_the_plan_callback_counts_steps_not_calls(per_call, ends):
    # With steps_per_execution, Keras calls back once per call of the train function:
    # 12 steps in calls of 2 or 3, intervals of 5 steps end at the first call's end at
    # or past steps 5 and 10 (counting calls, 3 and 2 calls in, they ended at steps
    # 10 only, and at none).
    import tf_keras as keras

    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    model = small_model(strategy)
    model.compile(optimizer=model.optimizer, loss="mse", steps_per_execution=per_call)
    ended = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if len(callback.history) > len(ended):
                ended.append(int(model.optimizer.iterations.numpy()))

    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=5, link_margin=None)
    model.fit(*small_data(48), batch_size=4, epochs=1, steps_per_epoch=12, verbose=0,
              callbacks=[callback, Steps()])
    assert ended == ends


def test_a_change_of_plan_must_pay_for_itself_over_the_rest_of_the_fit():
    # One worker: the fit's length is Keras' epochs times steps; a change's cost is
    # spread over the steps left of it, and over an interval where fewer are left or
    # the length is unknown.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    model = small_model(strategy)
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=5, link_margin=None)
    left = []
    import tf_keras as keras

    class Left(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            left.append(callback._payback_steps())  # pylint: disable=protected-access

    model.fit(*small_data(32), batch_size=8, epochs=3, verbose=0, callbacks=[callback, Left()])
    # 4 steps per epoch, 12 in all: after step k, 12 - k are left, never under 5.
    assert left == [max(12 - k, 5) for k in range(1, 13)]
    callback.set_params({"epochs": 1})  # no steps per epoch: an interval
    assert callback._payback_steps() == 5  # pylint: disable=protected-access


def test_the_plan_callback_measures_the_link_within_its_share_of_training():
    # One worker whose link measurement takes PROBE_S: with an interval every 2 steps,
    # the callback asks for it only once the time since the last one lets it cost at
    # most ``link_share`` of the time.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    model = small_model(strategy)
    cdo, probe_s, share = strategy.cross_device_ops, 0.02, 0.25
    measure = cdo.replan
    probes = []

    def replan(margin, due=None):
        changed = measure(margin, due=due)  # worker 0's word, all-gathered
        if due:
            time.sleep(probe_s)
            probes.append(time.perf_counter())
        return changed

    cdo.replan = replan
    callback = tfgc.keras.AutoPlanCallback(strategy, every_steps=2, link_share=share)
    began = time.perf_counter()
    model.fit(*small_data(960), batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    spent = time.perf_counter() - began
    intervals = callback.costs
    assert len(intervals) == 60 and intervals[0]["link_due"]  # the first is measured
    assert [c["link_due"] for c in intervals].count(True) == len(probes) >= 2
    # Between two measurements, at least probe_s / share seconds (the first pays for
    # the one before it).
    gaps = np.diff(probes)
    assert np.all(gaps >= probe_s / share), gaps
    assert len(probes) * probe_s <= share * spent + probe_s
    # ... and not many more: the next interval's end after that time measures.
    step_s = spent / 120
    assert np.all(gaps <= probe_s / share + probe_s + 4 * step_s + 0.5), gaps


def test_auto_chooses_the_paths_itself():
    with pytest.raises(ValueError, match="leave `communication`='auto'"):
        tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto", communication="allgather")
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="qsgd",
                                                          communication="allgather")
    with pytest.raises(ValueError, match="leave `communication`='auto'"):
        strategy.compressor = "auto"


def test_a_single_worker_plans_everything_as_float32():
    # Nothing crosses a network: no candidate can pay for its CPU.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    model = small_model(strategy)
    assert strategy.compression_plan() is None
    model.fit(*small_data(32), batch_size=16, verbose=0)
    plan = strategy.compression_plan()
    assert [e.label for e in plan.entries] == ["fp32"]  # the 40x64 kernel; the rest is small
    reasons = {u["reason"] for u in strategy.uncompressed_gradients()}
    assert "auto's plan: float32 is the fastest on this link" in reasons
    assert "a/kernel" in plan.table()


def test_a_checkpoint_for_other_gradients_is_measured_again(tmp_path):
    # One worker: the record's figures are reused for the same gradients (no measuring)
    # and not for a model of other shapes.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    auto = strategy.cross_device_ops._auto  # pylint: disable=protected-access

    def fit(width, path=None):
        model = small_model(strategy, width)
        if path is not None:
            tf.train.Checkpoint(optimizer=model.optimizer).restore(path)
        model.fit(*small_data(32), batch_size=16, verbose=0)
        return model

    model = fit(64)
    path = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    assert auto.measurements == 1
    strategy.compressor = "auto"
    fit(64, path)
    assert auto.measurements == 1
    strategy.compressor = "auto"
    fit(32, path)
    assert auto.measurements == 2


def test_a_residual_saved_under_another_plan_goes_with_the_next_step(tmp_path, caplog):
    # A checkpoint written while the kernel went low rank (pinned), restored into a plan
    # that sends it float32 (one worker's own): its residual is sent with the next
    # step's gradient, as a change of plan sends it, not kept for a plan that may never
    # come back; and an info line says so, not a warning.
    from tfgc.distribute import state as state_lib
    x, y = small_data(16)
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    strategy.cross_device_ops.pin_plan("psgd2")
    model = small_model(strategy)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    kernel = model.layers[0].kernel
    residual = state_lib.get_state(model.optimizer).slot(kernel, 0)["residual"].numpy()
    assert 0.01 * np.abs(residual).max() > 100 * 1e-6  # its step far above the tolerance
    path = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    weights = model.get_weights()

    def step(restore):
        again = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
        other = small_model(again)
        other.set_weights(weights)
        if restore:
            tf.train.Checkpoint(optimizer=other.optimizer).restore(path)
        other.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert [e.label for e in again.compression_plan().entries] == ["fp32"]
        return other

    caplog.set_level(logging.INFO)
    restored, plain = step(True), step(False)
    said = [r for r in caplog.records if "restoring compression state" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said), said
    assert "another plan of 'auto'" in said[0].getMessage()
    # Plain SGD at 0.01: the restored step moved the kernel by the residual's 0.01 more.
    moved = restored.layers[0].kernel.numpy() - plain.layers[0].kernel.numpy()
    np.testing.assert_allclose(moved, -0.01 * residual, atol=1e-6)
    state = state_lib.get_state(restored.optimizer)
    assert not np.any(state.carried(restored.layers[0].kernel, 0).numpy())  # sent once
    # Restored again into the traced step, which reads what is kept apart for the
    # kernel: the residual is kept apart again, once (not added to what was there).
    for _ in range(2):
        tf.train.Checkpoint(optimizer=restored.optimizer).restore(path)
        np.testing.assert_array_equal(state.carried(restored.layers[0].kernel, 0).numpy(),
                                      residual)
        assert state.carried_pending(0).numpy()
    # Into a traced step that keeps nothing apart for it, it waits, and the log says so.
    caplog.clear()
    tf.train.Checkpoint(optimizer=plain.optimizer).restore(path)
    assert state_lib.get_state(plain.optimizer).carried(plain.layers[0].kernel, 0) is None
    assert any("wait for the next trace of the step" in r.getMessage() for r in caplog.records)


def test_a_record_of_the_first_format_is_read_as_one_layout():
    # Records written before a plan per layout held the one layout's part beside the
    # figures (format 1); restored, they serve that layout as before, measuring nothing.
    strategy = tfgc.CompressedMultiWorkerMirroredStrategy(compressor="auto")
    auto = strategy.cross_device_ops._auto  # pylint: disable=protected-access
    small_model(strategy).fit(*small_data(32), batch_size=16, verbose=0)
    record = auto.snapshot()
    assert record["format"] == 2 and len(record["layouts"]) == 1
    (part,) = record.pop("layouts")
    old = dict(record, format=1, **part)
    strategy.compressor = "auto"
    auto.restored(old)
    small_model(strategy).fit(*small_data(32), batch_size=16, verbose=0)
    assert auto.measurements == 1
    assert auto.snapshot() == record | {"layouts": [part]}


# -- a real cluster ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return run_cluster(tmp_path_factory, "auto", SCRIPT)


def _per_worker(cluster, name):
    """Both workers' ``<name>.w<rank>.json``."""
    out = []
    for r in range(2):
        with open(cluster / f"{name}.w{r}.json") as f:
            out.append(json.load(f))
    return out


def _load(cluster, k, rank):
    with open(cluster / f"fixed{k}.w{rank}.json") as f:
        meta = json.load(f)
    return meta, np.load(cluster / f"fixed{k}.w{rank}.npz")


def _bf16_ring_sum(a, b):
    # Two workers: the ring adds the two bf16 payloads once, in bf16.
    return tf.cast(tf.cast(a, tf.bfloat16) + tf.cast(b, tf.bfloat16), tf.float32).numpy()


def test_every_worker_derives_the_same_plan(cluster):
    for k in range(len(worker.FIXED)):
        plans = [_load(cluster, k, r)[0] for r in range(2)]
        assert plans[0]["plan"] == plans[1]["plan"]
        assert plans[0]["digest"] == plans[1]["digest"]
    measured = _per_worker(cluster, "results")
    assert measured[0]["plan"] == measured[1]["plan"]
    assert measured[0]["link"] == measured[1]["link"]
    assert measured[0]["link"][1] > 0  # a measured link has a rate


def test_a_mixed_plan_sends_each_gradient_as_its_candidate_does(cluster):
    meta, outs = _load(cluster, 0, 0)
    labels = [e["label"] for e in meta["plan"]]
    # Rotated 8 bits on the largest kernel would exceed the budget (0.00025 x 80 % of
    # the elements); on the two others it fits.
    assert labels == ["bf16", "rqsgd8", "rqsgd8"], meta["table"]
    assert meta["mean_error"] <= 0.00015
    _check_outputs(cluster, 0)


def test_rotated_4_bits_where_the_budget_has_room_for_them(cluster):
    meta, _ = _load(cluster, 2, 0)
    labels = [e["label"] for e in meta["plan"]]
    # 0.068 on the small kernels' 20 % of the elements and 0.00025 on the rest.
    assert labels == ["rqsgd8", "rqsgd4", "rqsgd4"], meta["table"]
    assert meta["mean_error"] <= 0.02
    _check_outputs(cluster, 2)


def _check_outputs(cluster, k):
    """Fixed plan ``k``'s outputs: the same bits on both workers; the bias exact, bf16
    as the bf16 ring sums, the quantizers unbiased within the bound the plan counted."""
    meta, outs = _load(cluster, k, 0)
    by_shape = {tuple(e["shape"]): e for e in meta["plan"]}
    other = _load(cluster, k, 1)[1]
    for step in range(worker.STEPS):
        inputs = [worker.gradients(r, step) for r in range(2)]
        for j, shape in enumerate(worker.SHAPES):
            out = outs[f"out{step}_{j}"]
            np.testing.assert_array_equal(out, other[f"out{step}_{j}"])  # same bits
            a, b = inputs[0][j], inputs[1][j]
            entry = by_shape.get(shape)
            if entry is None:  # the bias: the policy sends it dense
                np.testing.assert_allclose(out, a + b, rtol=1e-6)
            elif entry["label"] == "bf16":
                np.testing.assert_array_equal(out, _bf16_ring_sum(a, b))
            else:
                # Unbiased, each worker's error within the bound the plan counted.
                err = np.sum((out - a - b) ** 2) / (np.sum(a ** 2) + np.sum(b ** 2))
                assert 0 < err <= entry["error"], (shape, err)


def test_the_bytes_sent_are_those_the_plan_counted(cluster):
    meta, _ = _load(cluster, 0, 0)
    stats = meta["stats"]
    bias = 2 * 1 / 2 * 4 * 40  # the ring's share of the dense bias
    planned = sum(e["sent_bytes"] for e in meta["plan"])
    # The plan counts the control words once per gradient; the path once per call.
    assert abs(stats["sent_bytes"] - planned - bias) <= 0.01 * planned
    assert stats["uncompressed_tensors"] == 1  # the bias


def test_a_fast_link_sends_every_gradient_as_float32_exactly(cluster):
    meta, outs = _load(cluster, 1, 0)
    assert {e["label"] for e in meta["plan"]} == {"fp32"}
    reasons = [u["reason"] for u in meta["uncompressed"]]
    assert reasons.count("auto's plan: float32 is the fastest on this link") == 3
    for step in range(worker.STEPS):
        inputs = [worker.gradients(r, step) for r in range(2)]
        for j in range(len(worker.SHAPES)):
            np.testing.assert_allclose(outs[f"out{step}_{j}"], inputs[0][j] + inputs[1][j],
                                       rtol=1e-6)


def test_replanning_measures_the_link_again_and_every_worker_agrees(cluster):
    runs = [run["replan"] for run in _per_worker(cluster, "results")]
    assert runs[0]["after"] == runs[1]["after"]  # the slowest worker's, everywhere
    assert runs[0]["plan"] == runs[1]["plan"]
    # Worker 0's "not due" held on both workers (worker 1 said due): nothing measured.
    for run in runs:
        assert run["skipped"] is False and run["unmeasured"] == run["before"]
    # Three medians in microseconds do not all come back the same.
    assert runs[0]["after"] != runs[0]["before"]


def test_critical_regimes_follow_accordions_rule_on_every_worker(cluster):
    runs = _per_worker(cluster, "regimes")
    assert runs[0] == runs[1]
    epochs, history = runs[0]["epochs"], runs[0]["history"]
    # Each interval's plan, norms and critical set, for the messages below.
    story = [(h, [(e["name"], e["label"], e["critical"]) for e in x["plan"]], x.get("norms"))
             for h, x in zip(history, epochs)]
    assert len(epochs) == len(history) == worker.EPOCHS, story
    # The first interval: every planned gradient critical, so no more error than bf16.
    assert all(e["critical"] and e["label"] in ("fp32", "bf16") for e in epochs[0]["plan"]), \
        story
    previous = {}
    for k, (epoch, critical, _) in enumerate(history):
        assert epoch == k
        norms = {int(j): v for j, v in epochs[k]["norms"].items()}
        # (mean, noise, level): steps of other batches differ, so each has noise.
        assert all(mean > 0 and noise > 0 and level > 0
                   for mean, noise, level in norms.values()), story
        names = [e["name"] for e in epochs[k]["plan"]]
        want = planner.critical_layers(previous, norms, 0.5)
        assert sorted(names[j] for j in want) == critical, (k, story)
        if not previous:
            assert critical == sorted(names)  # no previous interval: all critical
        previous = norms
        if k + 1 < len(epochs):
            # The next interval trains with exactly those limited; on a 1 Mbit/s link
            # with a budget of 2 the others take 4 bits (``worker.regimes``).
            for e in epochs[k + 1]["plan"]:
                assert e["critical"] == (e["name"] in critical), (k, story)
                assert e["label"] in (("fp32", "bf16") if e["critical"] else ("rqsgd4",)), \
                    (k, story)


def test_a_restored_checkpoint_brings_the_plan_back_unless_the_link_moved(cluster):
    runs = _per_worker(cluster, "restart")
    assert runs[0] == runs[1]
    run = runs[0]
    assert run["restored"] == run["saved"]
    # The saved figures, not a new measurement (whose medians would differ): the link
    # measured at the restore was within RESTORED_LINK_FACTOR of them.
    saved, restored, elsewhere = run["link_us"]
    assert restored == saved
    assert run["relinked"][0] == 0
    # The record as if written on a link 50 times slower: the link measured at the
    # restore replaced it (the first run's link, give or take this host's noise, not
    # 50 times it), the plan was made afresh, and nothing but the link was measured.
    assert run["relinked"][1] == 1
    assert all(e < 10 * s for s, e in zip(saved, elsewhere)), (saved, elsewhere)
    first, after = run["measurements"]
    assert first >= 1 and after == first
    # The measured record restored under a given link was planned afresh for it
    # (within the factor or not); its own record, under the same given link, came back
    # with its plan, not planned afresh; neither measured.
    (relinked_given, rate, plan), (relinked_again, rate_again, plan_again) = run["given"]
    assert relinked_given == run["relinked"][1] + 1 and rate == 0.002
    assert relinked_again == relinked_given and rate_again == 0.002
    assert plan_again == plan and plan != run["saved"], run
    assert run["given_record"] == [0.002, 0.1]


def test_measured_matrices_go_low_rank_after_the_critical_intervals(cluster):
    runs = _per_worker(cluster, "low_rank")
    assert runs[0] == runs[1]  # the same measurements and plans on every worker
    intervals = runs[0]["intervals"]
    assert len(intervals) == 6
    # Measured once the first plan's steps are timed, while every gradient is
    # critical: the kernels go low-rank at twice the budget's rank or more.
    first = runs[0]["first"]
    # Step 0 traces and step 1 settles; or the first interval's end, which measures too.
    callback = tfgc.keras.AutoPlanCallback
    assert runs[0]["first_at"] == min(callback.SETTLE_STEPS + callback.LOW_RANK_AFTER,
                                      worker.LOW_RANK_EVERY - 1)
    assert all(e["critical"] for e in first)
    assert any(e["label"].startswith("psgd") for e in first), first
    assert all(int(e["label"][4:]) >= 4 for e in first if e["label"].startswith("psgd"))
    # The first interval ends critical (nothing to compare it with); from the second
    # on, none is.
    for k, interval in enumerate(intervals):
        errors = {name: (sq, {(int(r) if r.isdigit() else r): e for r, e in rel.items()})
                  for name, (sq, rel) in interval["errors"].items()}
        assert errors, k
        for sq, rel in errors.values():
            assert sq > 0
            values = [rel[r] for r in planner.RANKS]
            assert all(0.0 <= v <= 1.0 for v in values)
            assert all(a >= b - 1e-6 for a, b in zip(values, values[1:]))  # more rank, less lost
            # Top-k's: its largest 1 % of the entries hold at least 1 % of the energy.
            assert set(rel) == set(planner.RANKS) | {"topk1"}
            assert 0.0 <= rel["topk1"] <= 1.0 - planner.TOPK_RATIO + 1e-6
        ranks = {e["name"]: int(e["label"][4:]) for e in interval["plan"]
                 if e["label"].startswith("psgd")}
        critical = {e["name"] for e in interval["plan"] if e["critical"]}
        assert critical == ({e["name"] for e in interval["plan"]} if k == 0 else set())
        assert all(ranks[name] >= 4 for name in critical & set(ranks))
        # On a 10 Mbit/s link low rank sends the kernels, within the measured budget.
        assert ranks, interval["plan"]
        shapes = {e["name"]: e["shape"] for e in interval["plan"]}
        budget = planner.LowRank(2, errors).budget(shapes)
        assert interval["low_rank_budget"] == pytest.approx(budget, rel=1e-6)
        assert interval["low_rank_error"] <= budget * (1 + 1e-6)
    # The errors are those of each gradient alone: recomputed from the gradients worker 0
    # kept, they match at every interval's end, though the plan before it sent some
    # low-rank (asserted above), whose residual error feedback holds.
    with open(cluster / "low_rank_recomputed.w0.json") as f:
        recomputed = json.load(f)
    assert len(recomputed) == len(intervals)
    for interval, again in zip(intervals, recomputed):
        assert set(again) == set(interval["errors"])
        for name, (sq, rel) in interval["errors"].items():
            assert again[name][0] == pytest.approx(sq, rel=1e-5), name
            for key, value in rel.items():
                assert again[name][1][key] == pytest.approx(value, rel=1e-4, abs=1e-6), \
                    (name, key)
    first, other = (np.load(cluster / f"low_rank.w{r}.npz") for r in range(2))
    for key in first.files:
        np.testing.assert_array_equal(first[key], other[key])
    losses = runs[0]["losses"]
    assert losses[-1] < losses[0], losses
    # Worker 0's steps, by plan (the same on both workers, above): the first plan's
    # and those that ran an interval, each with the communication it predicted.
    steps = runs[0]["steps"]
    assert len(steps) >= 2, steps
    keys = {"auto:" + ";".join(f"{e['name']}={e['label']}@{e['path']}" for e in i["plan"])
            for i in intervals}
    assert set(steps) & keys, (sorted(steps), sorted(keys))
    for comm, step, se in steps.values():
        assert comm > 0 and 0 < step < 60 and 0 <= se < step


@pytest.mark.parametrize("k", range(len(worker.MOVED_TO)))
def test_a_gradient_moved_off_low_rank_sends_its_residual_once(cluster, k):
    # Low rank, then a plan without it (quantizers; float32 alone): a step of zero
    # gradients sends the sum of the workers' residuals through the new candidates,
    # and nothing is left held back; a step skipped for a NaN before it sends none.
    runs = [np.load(cluster / f"moved.w{r}.npz") for r in range(2)]
    labels = list(runs[0][f"labels{k}"])
    assert any(label.startswith("psgd") for label in labels), labels
    assert not any(label.startswith("psgd") for label in runs[0][f"moved_to{k}"])
    for j, label in enumerate(labels):
        if not label.startswith("psgd"):
            continue
        want = runs[0][f"residual{k}_{j}"] + runs[1][f"residual{k}_{j}"]
        assert np.linalg.norm(want) > 0
        if k == 0:  # a skipped step left what was kept apart as it was
            for r, run in enumerate(runs):
                np.testing.assert_array_equal(run[f"after_skip{k}_{j}"],
                                              run[f"residual{k}_{j}"])
        for run in runs:
            out = run[f"out{k}_{j}"]
            # float32 exactly; the quantizers within a few percent (bf16: 2**-8 per
            # element, rotated 8 bits: a relative variance of 0.00025).
            assert np.linalg.norm(out - want) <= (1e-5 if k else 0.05) * np.linalg.norm(want)
            assert not np.any(run[f"carried{k}_{j}"])  # zeroed: sent once
    for run in runs:  # and let go at the next change of plan
        assert not np.any(run[f"kept_after{k}"])


@pytest.mark.parametrize("k", range(len(worker.SWITCHED_TO)))
def test_a_switch_off_error_feedback_sends_the_residual_once(cluster, k):
    # Error feedback, then a compressor that keeps no residual (QSGD and bf16 on tfgc's
    # path, identity on the stock all-reduce): a step that worker 1's NaN skips keeps
    # what was kept apart; a step of zeros sends the sum of the workers' residuals,
    # once.
    runs = [np.load(cluster / f"switched.w{r}.npz") for r in range(2)]
    compressed = [j for j, shape in enumerate(worker.SHAPES) if len(shape) == 2]
    for j in range(len(worker.SHAPES)):
        want = runs[0][f"residual{k}_{j}"] + runs[1][f"residual{k}_{j}"]
        if j not in compressed:  # the bias goes dense: no residual, nothing kept apart
            assert not np.any(want)
            assert all(run[f"carried{k}_{j}"].size == 0 for run in runs)
            continue
        # top-1 %: nearly all of the gradient held back
        assert np.linalg.norm(want) > 0.9 * np.sqrt(2 * np.prod(worker.SHAPES[j]))
        for run in runs:
            np.testing.assert_array_equal(run[f"after_skip{k}_{j}"],
                                          run[f"residual{k}_{j}"])
            # bf16: each worker's value rounded to 8 significant bits, summed in float32;
            # QSGD: unbiased, E||error||^2 within its variance bound of ||sum||^2 (two
            # workers' independent errors), allowed three standard deviations' worth.
            spec = worker.SWITCHED_TO[k]
            tolerance = {"bf16": 2.0 ** -7, "none": 1e-6}.get(spec) or 3 * np.sqrt(
                get_compressor(spec).variance_bound(int(np.prod(worker.SHAPES[j]))))
            out = run[f"out{k}_{j}"]
            assert np.linalg.norm(out - want) <= tolerance * np.linalg.norm(want)
            assert not np.any(run[f"carried{k}_{j}"])  # zeroed: sent once
            # Back under error feedback, the zeros joined the new residual: still zero.
            assert run[f"residual_after{k}_{j}"].shape == worker.SHAPES[j]
            assert not np.any(run[f"residual_after{k}_{j}"])
    for run in runs:
        # Awaiting sending after the skipped step; once sent, steps read only the flag.
        assert run[f"pending_after_skip{k}"] and not run[f"pending_after_send{k}"]
        assert not np.any(run[f"kept_after{k}"])  # and let go at the next switch


def test_a_model_learns_under_a_measured_plan(cluster):
    results = assert_fit_identical_and_learning(cluster, 2)
    assert len(results["plan"]) >= 1
    assert "tfgc: compressor='auto' plan" in results["table"]


def test_each_embedding_table_goes_dense_or_as_rows_as_the_plan_prices_it(cluster):
    # Step 8 of the worker: a small table whose every row a step touches and a large one
    # of which it touches FEW_ROWS, on a slow given link under AutoPlanCallback.
    runs = _per_worker(cluster, "tables")
    for a, b in zip(runs[0]["plans"], runs[1]["plans"]):
        assert a["digest"] == b["digest"] and a["tables"] == b["tables"]
    plans = runs[0]["plans"]
    first = {t["name"].split("/")[0]: t for t in plans[0]["tables"]}
    # The first plan comes before any step counted the rows: both go as rows.
    assert set(first) == {"small_table", "large_table"}
    assert not any(t["dense"] or t["rows"] for t in first.values()), plans[0]["table"]
    for plan in plans[1:]:
        tables = {t["name"].split("/")[0]: t for t in plan["tables"]}
        small, large = tables["small_table"], tables["large_table"]
        assert small["dense"] and not large["dense"], plan["table"]
        assert 0 < large["rows"] <= worker.FEW_ROWS and small["rows"] > worker.FEW_ROWS
        # The dense table is planned (compressed: the link is slow); the rows quantized.
        entry = [e for e in plan["entries"] if e["name"] == small["name"]]
        assert len(entry) == 1 and entry[0]["label"] != "fp32"
        assert large["label"] != "fp32" and f"{large['name']}=rows:{large['label']}" \
            in plan["key"]
    # Each gradient's last interval (mean, noise, level) of LOW_RANK_EVERY steps, the
    # tables' too: the large table's rows differ from step to step, so its squared
    # norms summed over the interval (rows that repeat summed first) exceed the sum's
    # over its steps: noise.
    norms = runs[0]["norms"]
    assert runs[1]["norms"] == norms
    assert {name.split("/")[0] for name in norms} >= {"small_table", "large_table"}, norms
    for name, (mean, noise, level) in norms.items():
        assert mean > 0 and noise >= 0 and math.isfinite(noise), norms
        assert level == pytest.approx(noise * math.sqrt(worker.LOW_RANK_EVERY), rel=1e-6)
        if name.startswith("large_table"):
            assert noise > 0, norms
    # What the last plan's steps sent is what it counted: its entries, its rows and the
    # gradients it leaves dense (on two workers the ring sends each one's bytes once).
    last, stats = plans[-1], runs[0]["stats"]
    counted = (sum(e["sent_bytes"] for e in last["entries"])
               + sum(t["sent_bytes"] for t in last["tables"] if not t["dense"])
               + sum(u["bytes"] for u in runs[0]["uncompressed"]
                     if not u["reason"].startswith("auto's plan")))  # not in the entries
    assert abs(stats["sent_bytes"] - counted) <= 0.01 * counted, (stats, last["table"])
    # Every worker ends with the same weights, and the loss went down.
    weights = [np.load(cluster / f"tables.w{r}.npz") for r in range(2)]
    for key in weights[0].files:
        np.testing.assert_array_equal(weights[0][key], weights[1][key])
    losses = runs[0]["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_a_restored_checkpoint_sends_the_tables_as_its_plan_did(cluster):
    # Step 8's end: the first trace after the restore sends each table as the saved plan
    # did (dense or as rows), and that step's plan is the saved one, its tables priced
    # with the rows the saved plan counted. (It sent both as rows until a step had
    # counted them, then changed plan and traced again.)
    runs = _per_worker(cluster, "tables")
    saved = runs[0]["plans"][-1]
    assert any(t["dense"] for t in saved["tables"]) and not all(
        t["dense"] for t in saved["tables"]), saved["table"]
    for run in runs:
        assert len(run["restored"]) == 1
        restored = run["restored"][0]
        assert restored["key"] == saved["key"], (restored["table"], saved["table"])
        assert restored["tables"] == saved["tables"]


def test_a_step_its_rows_skip_adds_nothing_to_the_interval_sums(cluster):
    # Step 9 of the worker: a NaN in worker 1's rows of a large table skips the step
    # (counted non-finite), though the kernel's reduction alone was finite; worker 0's
    # interval sum of the kernel keeps the steps that went through, and those only.
    runs = [np.load(cluster / f"rows_skip.w{r}.npz") for r in range(2)]
    nan = worker.ROWS_NAN
    assert nan.count(True) == 1 and not nan[0] and not nan[-1]
    assert int(runs[0]["nonfinite_steps"]) == 1
    assert "fp32" not in runs[0]["labels"].tolist()  # the kernel was compressed
    kernels = [runs[0][f"kernel{s}"] for s in range(len(nan))]
    assert all(np.isfinite(k).all() for k in kernels)
    np.testing.assert_array_equal(runs[0]["kernel0"], runs[1]["kernel0"])
    total = np.zeros_like(kernels[0])
    for step, skipped in enumerate(nan):
        if not skipped:
            total += kernels[step]
        (sums,) = runs[0][f"sums{step}"]
        np.testing.assert_allclose(sums, total, rtol=1e-6, atol=1e-6)


def test_a_gradient_its_largest_entries_hold_goes_top_k_and_sums_as_top_k_does(cluster):
    # Step 10 of the worker: once out of its critical regime, the sparse kernel is
    # planned top-k on the all-gather, and each step's result is the sum of every
    # worker's k largest entries of gradient plus residual, each residual what is left.
    runs = [np.load(cluster / f"sparse.w{r}.npz") for r in range(2)]
    for r in (0, 1):
        assert "topk1" not in runs[r]["labels0"].tolist()  # critical: not top-k
        assert runs[r]["labels1"].tolist() == ["topk1"]
        assert runs[r]["paths"].tolist() == ["allgather"]
    k = planner.BY_LABEL["topk1"].compressor.inner.num_kept(tf.TensorShape(worker.SPARSE_SHAPE))
    assert k > worker.SPARSE_NONZEROS
    for step in range(worker.SPARSE_STEPS):
        total = np.zeros(worker.SPARSE_SHAPE, np.float32)
        for run in runs:
            x = (run[f"gradient{step}"] + run[f"before{step}"]).reshape(-1)
            # The k largest magnitudes, ties to the lower index.
            kept = np.lexsort((np.arange(x.size), -np.abs(x)))[:k]
            sent = np.zeros_like(x)
            sent[kept] = x[kept]
            total += sent.reshape(worker.SPARSE_SHAPE)
            np.testing.assert_array_equal(run[f"after{step}"].reshape(-1), x - sent)
        for run in runs:
            np.testing.assert_array_equal(run[f"out{step}"], total)


def test_models_trained_in_turn_each_get_a_plan_of_their_own_gradients(cluster):
    # Under AutoPlanCallback the interval sums were kept by place in the plan's layout:
    # the second model's first step added its [24, 64] kernel into the first model's
    # [48, 64] sum and failed to trace. Now its regimes start again with its own.
    runs = _per_worker(cluster, "alternating")
    assert runs[0] == runs[1]  # the same plans and losses on both workers
    plans, losses = runs[0]["plans"], runs[0]["losses"]
    assert all(math.isfinite(v) for v in losses), losses
    for width, plan in zip(worker.ALTERNATE_WIDTHS, plans):
        # Each fit's plan is of that model's gradients (the [64, 1] kernel and the
        # biases are below the policy's 1024 elements), compressed on a 1 Mbit/s link.
        assert [shape for _, shape, _ in plan] == [[width, 64]], (width, plan)
        assert plan[0][2] != "fp32", plan
    w0, w1 = (np.load(cluster / f"alternating.w{r}.npz") for r in range(2))
    for key in w0.files:
        np.testing.assert_array_equal(w0[key], w1[key])
        assert np.all(np.isfinite(w0[key]))


def test_a_bag_of_embeddings_is_planned_on_every_worker_alike(cluster):
    # The table alone is large enough to plan: its rows went float32 on the stock
    # gather, with no plan, on any link. Now the first step's plan sends them in a
    # quantizer of bf16's bound at most (every gradient critical at first, the rows
    # not counted yet); later plans price them counted (the steps' pace, not only the
    # given link, decides between quantized and float32 rows). Both workers alike.
    runs = _per_worker(cluster, "bag")
    assert runs[0] == runs[1]
    ((_, (table,)),) = runs[0]["first"]["plans"]
    assert table["name"] == "bag/embeddings:0" and not table["dense"], table
    assert table["label"] != "fp32" and planner.BY_LABEL[table["label"]].variance_bound(
        embeddings.BLOCK_ENTRIES) <= planner.CRITICAL_BOUND, table
    assert [u["variable"] for u in runs[0]["first"]["uncompressed"]] == [
        "head/kernel:0", "head/bias:0"], runs[0]["first"]  # the policy's, not the table
    ((key, (table,)),) = runs[0]["plans"]
    assert table["name"] == "bag/embeddings:0" and table["rows"] > 0, key
    assert (runs[0]["steps"], runs[0]["nonfinite"]) == (worker.BAG_STEPS, 0)
    assert np.all(np.isfinite(runs[0]["losses"]))
    w0, w1 = (np.load(cluster / f"bag.w{r}.npz") for r in range(2))
    for k in w0.files:
        np.testing.assert_array_equal(w0[k], w1[k])


def test_a_gan_plans_each_models_gradients_apart_and_adapts_both(cluster):
    # A train_step that applies two optimizers reduces two sets of gradients a step.
    # The planner held one plan: the second set's trace replaced the first's, whose
    # regimes then never moved, and compression_plan() showed one model. Now each set
    # has its plan and regimes, and a change of either retraces once.
    runs = _per_worker(cluster, "gan")
    for r in runs:
        del r["refusals"]  # each worker's own message
    assert runs[0] == runs[1]  # the same plans, generations and losses on both workers
    intervals = runs[0]["intervals"]
    assert len(intervals) == worker.GAN_STEPS // worker.GAN_EVERY
    sample, noise = worker.GAN_SAMPLE, worker.GAN_NOISE
    # The discriminator's gradients are reduced first, the generator's second.
    shapes = [[[sample, 64]], [[noise, 64], [64, sample]]]
    for interval in intervals:
        assert [[e[1] for e in plan] for plan in interval["plans"]] == shapes, interval
    # ACCORDION's first interval has no norm to compare with: every gradient critical.
    assert all(e[3] for plan in intervals[0]["plans"] for e in plan), intervals[0]
    # Each model's regimes move on from it: under the single plan the discriminator's
    # stayed critical for good.
    for k in range(len(shapes)):
        assert any(not e[3] for interval in intervals[1:] for e in interval["plans"][k]), k
    # Both models' changes at an interval's end take one new generation (one retrace).
    generations = [interval["generation"] for interval in intervals]
    assert all(0 <= b - a <= 1 for a, b in zip(generations, generations[1:])), generations
    # A timed step spent both sets' communication: each set's timed steps are set
    # against the sum of both plans' predictions (each set's own alone before), and
    # its pace prices the other's part as compute.
    timed = [interval for interval in intervals if None not in interval["timed"]]
    assert timed, intervals
    for interval in timed:
        predicted = interval["predicted"]
        assert min(predicted) > 0, interval
        assert interval["timed"] == pytest.approx([sum(predicted)] * 2, rel=1e-9), interval
    assert all(shared > 0 for shared in intervals[-1]["shared"]), intervals[-1]
    # compression_plan() is the plan of the gradients reduced last: the generator's.
    assert runs[0]["shown"] == [e[:3] for e in intervals[-1]["plans"][1]]
    # Both plans come back from the checkpoint of both optimizers, with nothing
    # measured (the record held the generator's alone, and the discriminator,
    # planned first after the restore, measured and planned both afresh).
    assert runs[0]["restored"] == runs[0]["saved"] and len(runs[0]["saved"]) == 2
    before, after = runs[0]["measurements"]
    assert after == before, runs[0]["measurements"]
    assert all(math.isfinite(v) for vs in runs[0]["losses"].values() for v in vs)
    w0, w1 = (np.load(cluster / f"gan.w{r}.npz") for r in range(2))
    for key in w0.files:
        np.testing.assert_array_equal(w0[key], w1[key])
        assert np.all(np.isfinite(w0[key]))


def test_a_pinned_plan_runs_on_every_worker_and_sends_what_it_counts(cluster):
    # pin_plan on both workers of the GAN restored above: both sets' gradients as the
    # pin says from the next step (one retrace, where it changed the plan), the same
    # plan on each worker, and the bytes on the wire those its entries count plus the
    # ring's share of the gradients the policy sends dense; given back, the planner's
    # own choice again.
    runs = _per_worker(cluster, "gan")
    pinned = runs[0]["pinned"]
    # Different choices: both workers refused; a choice one worker refused: it says
    # why, and the other that they differ.
    differ = "the workers' choices differ or some refused theirs"
    assert all(differ in r["refusals"][0] for r in runs)
    assert differ in runs[0]["refusals"][1]
    assert "'bf17' is not a candidate" in runs[1]["refusals"][1]
    assert pinned == runs[1]["pinned"]
    assert pinned["changed"] == (pinned["keys"] != runs[0]["restored"])
    assert pinned["generations"] == int(pinned["changed"])
    assert [len(plan) for plan in pinned["plans"]] == [1, 2]
    assert {(e[1], e[2]) for plan in pinned["plans"] for e in plan} == \
        {(worker.GAN_PIN, "pinned")}
    assert pinned["reductions"] == 4  # two steps of two sets
    counted = sum(e[3] for plan in pinned["plans"] for e in plan)
    dense = 2 * (2 - 1) / 2 * 4 * pinned["unplanned"]
    assert abs(pinned["sent"] - counted - dense) <= 0.01 * counted, pinned
    back = pinned["given_back"]
    assert pinned["released"] == ([key for key, _ in back] != pinned["keys"])
    assert not any(r.startswith("pinned") for _, reasons in back for r in reasons), back
