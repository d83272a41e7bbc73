"""``compressor="auto"``: what each gradient is sent as, from measured costs.

At the first gradient reduction under ``tfgc.compressors.Auto`` the cross-device ops
ask this module for a ``Plan``:

1. **Measure** (``measure``). Every worker times, on its own CPU (once per process),
   each compressing candidate's encoding and decoding of float32 vectors of ``CPU_SIZES`` elements,
   as a gradient costs inside a step (each timed call's own cost taken out,
   ``_cpu_seconds``), and, together, an all-reduce of ``LINK_SIZES`` bytes (the link;
   skipped when the user gives ``link_gbps``). The figures are medians of ``REPEATS``
   runs after one warm-up, in microseconds; the workers all-gather them and every worker keeps the
   largest of each (the slowest worker's), so every worker holds the same numbers.
2. **Model** (``Figures``, ``cpu_seconds``, ``sent_bytes``; the alpha-beta model of
   ``costmodel``). A straight line through the all-reduce times against the bytes each
   worker sent (2(N-1)/N of the vector on a ring) gives seconds per byte, and its
   intercept, over the ring's 2(N-1) hops, the seconds per hop; a line through each
   candidate's times against elements gives its encoding and decoding cost. A
   gradient of n elements under a candidate then costs CPU (the encodings and
   decodings its path runs, ``cpu_seconds``) plus wire time (the bytes its path sends
   per worker, as ``paths.auto.sent_bytes`` counts them, times seconds per byte).
3. **Choose** (``make_plan``). Each gradient takes the candidate that minimises its
   time + lambda * error, where error is the candidate's relative variance bound
   times the gradient's share of the planned elements (``Candidate.variance_bound``),
   and lambda is the smallest (found by bisection) that keeps the total within the
   budget; what that leaves of the budget goes, gradient by gradient, to the moves
   that save the most time per error added (``_fill``); a dynamic program over the
   budget cut into bins (``_knapsack``) finds the exchanges that one move at a time
   cannot, and the faster answer is kept: L-GreCo's problem (Markov et al., MLSys
   2024: per-layer compression under a total error bound) and its program. The
   same numbers give the same plan on every worker (Python floats, the same
   operations in the same order); ``autoplan`` checks it anyway, by an all-gather of
   its digest.

Latency: a candidate's group waits on the hops of its own path (``costmodel.hops``:
2(N-1) for the all-reduce, N-1 for the all-gather, about 2(N-1) for the
reduce-scatter), which the per-gradient choice does not see; ``_consolidate`` then
merges a group into another (or into float32, which rides with the biases'
all-reduce) where that saves time.
What the model leaves out, knowingly: a group cut into several buckets pays that
latency once per bucket; the overlap of the wire with back-propagation (so it leans
toward compressing); and the error that the ring's 16-bit partial sums add for bf16
beyond the rounding of each worker's gradient.

Over training (``CompressedAllReduce.replan`` and ``adapt``, which
``tfgc.keras.AutoPlanCallback`` calls at the end of each epoch): the link is measured
again and the plan made again when the predicted float32 all-reduce of the planned
gradients moves by more than a margin (``link_changed``); and gradients in a critical
regime (ACCORDION, Agarwal et al., MLSys 2021: the norm of a layer's gradient summed
over the interval changed by half or more since the previous one; every layer until
two intervals can be compared; here the norm of the interval's mean, by more than its
noise could move it, or where that noise hides it, the steps' spread by half:
``critical_layers``) take no quantizer with more error than bf16 (``critical``), and
low rank only as below.

Low rank (PowerSGD at ranks 1 to 8, with error feedback): no bound holds for every
gradient, so the end of an interval measures each matrix's error at every rank
(``low_rank_errors``, on the last step's local gradient) and the plan may
send a measured gradient low-rank within a second budget, L-GreCo's: the total error
of PowerSGD at ``Auto.low_rank`` on every measured gradient (``LowRank``). Until a
first measurement (once the first plan's steps are timed, ``AutoPlanCallback``) no
gradient goes low-rank, and in a critical regime only at ``Auto.critical_rank`` or
more (twice that rank by default) where it loses at most ``Auto.critical_error`` of
worker 0's last measured gradient there (a plan pinned by hand is exempt). A
plan that keeps a gradient low-rank at another rank keeps its residual (the state's
migration carries fields of the same shape); one that moves it off low rank adds the
residual to its next gradient (``CompressionState.carried``), so nothing it held is
lost.

Top-k at 1 % with error feedback (``SPARSE``, on the all-gather) is measured alike: the
share of a gradient's energy that its largest 1 % of entries leave (``top_k_errors``,
on the same gradient) counts in the same budget, and the first
measurement times its codecs with the low-rank ones. It is not offered in a critical
regime.

The steps a plan costs (``Pace``): a lossier plan needs more steps to reach the same
accuracy, so a step it makes shorter is not by itself time saved. Once steps have been
timed under a plan (``AutoPlanCallback`` passes the current plan's median step), the
planner fits each plan's measured step against the communication it predicted
(``pace_from``: compute, plus a scale of the prediction), and weighs a plan's low-rank
error at ``Auto.low_rank_steps`` more steps for a whole low-rank budget: a plan is
then chosen for its step times the steps it needs, so low rank is taken where it saves
more than its extra steps cost (a slow link), and not where compute is most of the
step (a fast one). The fit weighs each plan by its step's standard error, and a change
of plan is taken only where it pays at both ends of the slope's interval as well
(``change_pays``): two plans whose steps differ by less than their noise do not swap
back and forth. Or as a trial, which must pay twice at the fitted slope, and for what
it would lose at the interval's worst end over the steps it runs before they are
weighed, and lose nothing within one standard error of it (``is_trial``): its own
steps then say whether it stays. Before the steps have measured a slope (one plan
timed, or plans whose predictions are too close to tell apart), a change rests on the
link probe's prediction alone, and must pay for the change back as well
(``UNMEASURED_CHANGES``; on a given link the pace's line is what may call for it).
"""

import dataclasses
import functools
import itertools
import json
import math
import os
import platform
import tempfile
import time
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from absl import logging

from tfgc.collectives.allgather import num_payload_words
from tfgc.compressors import CompressContext, get as get_compressor
from tfgc.compressors.sparse import TopK
from tfgc.distribute import costmodel, embeddings
from tfgc.distribute.costmodel import ring_sent
from tfgc.distribute.paths import auto as auto_paths
from tfgc.distribute.paths import guard
from tfgc.ops import build as ops_build

# Bytes of the float32 vectors the link probe all-reduces, and elements of the vectors
# each candidate encodes and decodes: a line through three sizes, from a few kilobytes
# (where the fixed costs show) to a layer of a few megabytes. The link's first size is
# a message of 64 floats: its all-reduce is the latency alone (``link_line``).
LINK_SIZES = (256, 16 << 10, 512 << 10, 4 << 20)
# The probe's sizes before it had the 256-byte one (stored benchmark figures have them).
EARLIER_LINK_SIZES = LINK_SIZES[1:]
CPU_SIZES = (1 << 12, 1 << 16, 1 << 20)
# Timed calls per measurement, after one untimed (``median_seconds``) ...
REPEATS = 3
# ... and for the link's smallest size, the anchor of its line (the fixed cost of a
# collective, ``link_line``): on 2 cores its eager all-reduce ranged 2.2-3.4 ms from call
# to call (2.7-2.9 ms a collective inside a graph), and a median of three, the slower
# worker's, once put a hop at twice what the other probes of the same machine did.
LATENCY_REPEATS = 9
# A re-measurement of the link times a probe size only where the current figures predict
# its all-reduce under this (``measure_link``).
REPROBE_S = 0.05
# ... unless the largest size probed moved by more than this (relative): then all of them.
REPROBE_MARGIN = 0.2
# Vectors encoded (decoded) per timed call (``_cpu_seconds``), whose own overhead is
# then taken out (``_call_overhead``). A low-rank codec's graph is about ten times a
# quantizer's (a rank-8 PowerSGD encoding: 258 operations), and optimising it cost
# tens of milliseconds a copy against 1-3 ms of running it, so the low-rank
# candidates are timed on fewer copies.
COPIES = 8
LOW_RANK_COPIES = 2
# What a low-rank vector costs to time against a quantizer's (``timing_copies``), once
# each codec is traced once (``_codec``): optimising and running its copies. One idle
# process on 2 cores: 29 ms a low-rank vector, 7 ms a quantizer's, 5.5 ms top-k's.
LOW_RANK_COPY_COST = 4
# How a timing leaves the call's own overhead out (``_cpu_seconds``): timings kept on
# disk under another way are measured again. The overhead's two calls, on the least
# size, are timed this many times each: it is the difference of two timings.
TIMING = "per copy of one trace, less the call overhead"
OVERHEAD_REPEATS = 9


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to send a gradient: ``label`` for tables, ``spec`` for the registry
    (None: float32, as it is)."""

    label: str
    spec: Optional[str]

    @property
    def compressor(self):
        """A compressor of its own, to send with (None: float32)."""
        return None if self.spec is None else get_compressor(self.spec)

    @property
    def described(self):
        """The compressor the planner asks about its rank, bounds, paths and bytes: one
        instance per spec, shared (a plan asks it a few thousand times; parsing the
        spec each time was about half of a plan's time in a profile); never sent
        with."""
        return None if self.spec is None else _described(self.spec)

    @property
    def rank(self) -> Optional[int]:
        """The rank of a low-rank candidate (PowerSGD's), None for the others."""
        compressor = self.described
        return None if compressor is None or compressor.low_rank is None else compressor.rank

    @property
    def error_key(self):
        """Where a measured candidate's error is kept among a gradient's measured errors
        (``LowRank.errors``): a low-rank one's rank, top-k's label; None for the
        candidates whose error is a bound that holds for every gradient."""
        if self.label in _SPARSE_LABELS:
            return self.label
        return self.rank

    def variance_bound(self, num_elements: int) -> float:
        """The bound on E||C(g) - g||^2 / ||g||^2 for a gradient of ``num_elements``.

        A cast rounds to nearest with p significant bits, a relative error of at
        most 2**-p per element (bf16: p = 8). QSGD, rotated or not: its own bound
        (``QSGD.variance_bound``; for the l2 norm Alistarh et al., NIPS 2017,
        Lemma 3.1).
        """
        compressor = self.described
        if compressor is None:
            return 0.0
        if compressor.name == "bf16":
            return 2.0 ** -16
        if compressor.name == "qsgd":
            return compressor.variance_bound(num_elements)
        raise ValueError(f"no variance bound for candidate {self.spec!r}")


# The most error a gradient in a critical regime may take from a quantizer: bf16's.
CRITICAL_BOUND = 2.0 ** -16

# From the least error to the most; the order also breaks ties. The rotated ones
# (``QSGD(rotate=True)``) cost a Hadamard transform per encoding and decoding and
# lose far less: bounds 0.00025 (8 bits) and 0.068 (4 bits) against 8-bit QSGD's
# 0.032 on buckets of 512 and 128.
CANDIDATES = (
    Candidate("fp32", None),
    Candidate("bf16", "bf16"),
    Candidate("rqsgd8", "qsgd:levels=127,bucket_size=512,norm=max,rotate=true"),
    Candidate("qsgd8", "qsgd:levels=127,bucket_size=512"),
    Candidate("rqsgd4", "qsgd:levels=7,bucket_size=128,norm=max,rotate=true"),
)
# PowerSGD at these ranks, with error feedback (the low-rank path). Their error has no
# bound that holds for every gradient: it is measured on the gradients during training
# (``low_rank_errors``) and kept within a budget of its own, L-GreCo's (``LowRank``), so
# they are planned only once a measurement exists.
RANKS = (1, 2, 4, 8)
LOW_RANK = tuple(Candidate(f"psgd{r}", f"powersgd:rank={r}") for r in RANKS)
# Top-k with error feedback (1 % of the entries, on the all-gather): its error, too,
# depends on the gradient (how much of its energy its largest entries hold), so it is
# measured with the low-rank errors and shares their budget. Where a gradient's energy
# sits in few entries but not in few directions, it loses less than PowerSGD; and its
# bytes do not depend on the matrix's shape.
TOPK_RATIO = 0.01
SPARSE = (Candidate("topk1", f"ef+topk:ratio={TOPK_RATIO}"),)
_SPARSE_LABELS = frozenset(c.label for c in SPARSE)
# The low-rank candidates are timed at their least and greatest rank, on the least and
# greatest size; the other ranks and sizes are read off the lines between
# (``_low_rank_words``). PowerSGD's work on an n-element matrix is n r multiply-adds
# for each factor plus the factor's orthogonalisation, close to linear in r for the
# ranks planned. Four timed codecs instead of twelve (each one's graphs are built
# and optimised: 4 workers on 2 cores spent 4.5 s on twelve).
LOW_RANK_TIMED = ((RANKS[0], RANKS[-1]), (CPU_SIZES[0], CPU_SIZES[-1]))
# The candidates whose error is measured during training, and every candidate, in the
# order the figures hold them and the plan's groups run.
MEASURED = LOW_RANK + SPARSE
ALL = CANDIDATES + MEASURED
BY_LABEL = {c.label: c for c in ALL}


@functools.lru_cache(maxsize=None)
def _described(spec: str):
    return get_compressor(spec)


def path_of(candidate: Candidate, num_workers: int) -> str:
    """The path a candidate's gradients take: auto's choice for its compressor."""
    if candidate.spec is None:
        return "allreduce"
    return auto_paths.choose_communication(candidate.described, num_workers)[0]


# -- measuring ----------------------------------------------------------------------

def median_seconds(fn, repeats: int = REPEATS) -> float:
    """The median of ``repeats`` timed calls of ``fn``, after one untimed."""
    fn()  # warm-up: traces, allocates, and lines the workers up at a collective
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


@functools.lru_cache(maxsize=1)
def _codec(candidate: Candidate, dims: Tuple[int, ...], num_workers: int):
    """``candidate``'s encoding and decoding of a float32 tensor of shape ``dims``,
    each traced once as a function of the tensor (the payload) and the copy's index.
    The last one is kept for the next timing of the same codec and shape (the call
    overhead's two calls)."""
    shape = tf.TensorShape(dims)
    compressor = candidate.compressor
    state = compressor.init_state(shape, tf.float32)
    step = tf.constant(0, tf.int64)

    def context(index):
        return CompressContext(rank=0, num_workers=num_workers, index=index, step=step)

    index = tf.TensorSpec([], tf.int32)  # as a step's Python int index folds in
    encode = tf.function(lambda v, i: tuple(compressor.compress(v, state, context(i))[0]),
                         autograph=False).get_concrete_function(
                             tf.TensorSpec(shape, tf.float32), index)
    payload = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                    encode.structured_outputs)
    if not all(p.shape.is_fully_defined() for p in tf.nest.flatten(payload)):
        raise ValueError(f"{candidate.spec!r}'s payload has a shape known only when it "
                         f"runs ({payload}): its decoding cannot be timed as traced once")
    decode = tf.function(lambda p, i: compressor.decompress(p, shape, tf.float32, context(i)),
                         autograph=False).get_concrete_function(payload, index)
    return encode, decode


def _call_seconds(candidate: Candidate, n: int, num_workers: int, copies: int,
                  shape: Optional[Sequence[int]] = None,
                  repeats: int = REPEATS) -> Tuple[float, float]:
    """Median seconds of one call that encodes (one that decodes) ``copies`` float32
    vectors of ``n`` elements (or of ``shape``: a square matrix for low-rank codecs,
    whose cost depends on it, where none is given).

    Each copy is a call of one traced encoding (decoding, ``_codec``) on its own input
    and index; TensorFlow inlines the calls when it optimises the graph, so the graph
    that runs holds the copies' operations as separately traced copies made it, and
    Python traces the codec once rather than once a copy, which was about a third of a
    timing's seconds (see docs/results.md, "Timing a codec once")."""
    if shape is None and candidate.rank is not None:
        side = int(round(math.sqrt(n)))  # a square matrix: the low-rank codec's work is n r
        shape = [side, max(n // side, 1)]
    shape = tf.TensorShape(shape or [n])
    encode_one, decode_one = _codec(candidate, tuple(shape.as_list()), num_workers)
    xs = [tf.random.stateless_normal(shape, seed=[7, n + k]) for k in range(copies)]
    indices = [tf.constant(k, tf.int32) for k in range(copies)]
    encode = tf.function(lambda vs: [encode_one(v, i) for v, i in zip(vs, indices)],
                         autograph=False)
    payloads = encode(xs)
    decode = tf.function(lambda ps: [decode_one(p, i) for p, i in zip(ps, indices)],
                         autograph=False)
    # A call on the CPU returns once its graph ran (eager execution is synchronous), so
    # nothing is read back: a step never copies its payloads out of the graph. Where an
    # accelerator may run the codec, its queue is waited for instead.
    wait = tf.test.experimental.sync_devices if tf.config.list_logical_devices("GPU") \
        else (lambda: None)
    return (median_seconds(lambda: (encode(xs), wait()), repeats),
            median_seconds(lambda: (decode(payloads), wait()), repeats))


def _copies(candidate: Candidate) -> int:
    """Vectors per timed call: ``COPIES``, ``LOW_RANK_COPIES`` for low-rank codecs."""
    return COPIES if candidate.rank is None else LOW_RANK_COPIES


@functools.lru_cache(maxsize=None)
def _least_calls(candidate: Candidate, num_workers: int):
    """``_call_seconds`` of the copies and of twice as many, on ``CPU_SIZES[0]``
    elements, each the median of ``OVERHEAD_REPEATS`` calls (they cost little)."""
    copies = _copies(candidate)
    return tuple(_call_seconds(candidate, CPU_SIZES[0], num_workers, k,
                               repeats=OVERHEAD_REPEATS) for k in (copies, 2 * copies))


def _call_overhead(candidate: Candidate, num_workers: int) -> Tuple[float, float]:
    """The seconds a timed call spends beyond its vectors' graphs, encoding and
    decoding: twice a call of the copies less a call of twice as many (``_least_calls``),
    at least 0 and at most the first call."""
    once, twice = _least_calls(candidate, num_workers)
    return tuple(min(max(2.0 * a - b, 0.0), a) for a, b in zip(once, twice))


def _cpu_seconds(candidate: Candidate, n: int, num_workers: int,
                 shape: Optional[Sequence[int]] = None) -> Tuple[float, float]:
    """Seconds of one encoding and one decoding of a float32 vector of ``n`` elements
    (or of ``shape``, for codecs whose cost depends on it: low-rank ones), as a
    gradient costs inside a training step's graph, where it has no call of its own: a
    timed call of ``COPIES`` vectors (``LOW_RANK_COPIES`` for low-rank codecs) less
    the call's own cost (``_call_overhead``), divided by them. On 2 cores a call cost
    0.2-0.5 ms, against 10-50 us of a small vector's cast or quantization (see
    docs/results.md, "What a gradient's codec costs in the step")."""
    copies = _copies(candidate)
    if n == CPU_SIZES[0] and shape is None:
        calls = _least_calls(candidate, num_workers)[0]
    else:
        calls = _call_seconds(candidate, n, num_workers, copies, shape)
    return tuple(max(t - o, 0.0) / copies
                 for t, o in zip(calls, _call_overhead(candidate, num_workers)))


# This process's own CPU timings by cluster size and candidates: the CPU does not change
# when a new plan is made (another compressor, another model), so only the first plan
# pays for them.
_CPU_WORDS: Dict[Tuple[int, Tuple[str, ...]], List[int]] = {}
# They are kept on disk as well (``cpu_cache_path``), by machine, TensorFlow, tfgc and
# timing setup, so a later job on the same machine skips them: with 4 workers on 2 cores
# they are 5.5-5.9 s of the first step, 2.2-2.3 s on one idle process (see
# docs/results.md, "Timing a codec once"). "0" in this variable neither reads nor writes it,
# "1" (or nothing) keeps the default file, and any other value is the path of the file to
# keep them in (a relative one from the working directory).
CPU_CACHE_ENV = "TFGC_AUTO_CPU_CACHE"


def cpu_cache_path() -> str:
    """Where the CPU timings are kept: the file ``$TFGC_AUTO_CPU_CACHE`` names, where
    it is neither "0" (none: see ``_use_disk``) nor "1" nor empty, relative to the
    working directory unless absolute; else ``auto/cpu.json`` under tfgc's cache root
    (``$TFGC_CACHE_DIR``, else ``$XDG_CACHE_HOME/tfgc``, else ``~/.cache/tfgc``)."""
    setting = os.environ.get(CPU_CACHE_ENV, "").strip()
    if setting not in ("", "0", "1"):
        return os.path.abspath(os.path.expanduser(setting))
    return os.path.join(ops_build.cache_root(), "auto", "cpu.json")


def _disk_key(key) -> str:
    """What a timing depends on beyond this process: the machine, the software, how it
    was timed, the candidates, the cluster size and the threads TensorFlow runs."""
    import tfgc  # pylint: disable=import-outside-toplevel
    threading_ = tf.config.threading
    return json.dumps([tfgc.__version__, tf.__version__, platform.machine(),
                       ops_build.cpu_model(), os.cpu_count(),
                       threading_.get_intra_op_parallelism_threads(),
                       threading_.get_inter_op_parallelism_threads(), COPIES,
                       LOW_RANK_COPIES, CPU_SIZES, REPEATS, LOW_RANK_TIMED, TIMING,
                       OVERHEAD_REPEATS,
                       [c.spec for c in ALL], key[0], list(key[1])])


def _read_cpu_cache() -> dict:
    try:
        with open(cpu_cache_path()) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _use_disk() -> bool:
    return os.environ.get(CPU_CACHE_ENV, "1").strip() != "0"


def _valid_words(words, length: int) -> bool:
    return isinstance(words, list) and len(words) == length and all(
        isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2 ** 31 for w in words)


def _kept_words(key, length: int, cache: Optional[dict] = None) -> Optional[List[int]]:
    """``key``'s words as this process or the disk keeps them (``length`` of them), or
    None where neither does; ``cache``: the disk's entries, where already read."""
    if key in _CPU_WORDS:
        return _CPU_WORDS[key]
    if not _use_disk():
        return None
    words = (_read_cpu_cache() if cache is None else cache).get(_disk_key(key))
    return words if _valid_words(words, length) else None


# What timing a codec copy (``timing_copies``) cost on this machine: the last timing of
# this process (its cluster size's), which is kept on disk as well under this key's
# labels, so a later job that finds the quantizers' timings on disk still knows it.
_COPY_SECONDS: Dict[int, float] = {}
_COPY_KEY = ("seconds per timed copy",)


def _cached_words(key, length: int, measure, copies: int = 0) -> List[int]:
    """``_CPU_WORDS[key]``: this process's, else the disk's (``length`` words), else
    ``measure()``'s, which are then kept in both; ``measure`` times ``copies`` codec
    copies (``timing_copies``), and what each cost is kept too (``_COPY_SECONDS``)."""
    if key in _CPU_WORDS:
        return _CPU_WORDS[key]
    words = _kept_words(key, length)
    if words is not None:
        logging.info("tfgc: compressor='auto': CPU timings of %s from %s", ", ".join(key[1]),
                     cpu_cache_path())
    else:
        began = time.perf_counter()
        try:
            words = measure()
        finally:
            _codec.cache_clear()  # its state and graphs: the timing is done
        if copies:
            _COPY_SECONDS[key[0]] = (time.perf_counter() - began) / copies
        if _use_disk():
            entries = {_disk_key(key): words}
            if copies:
                entries[_disk_key((key[0], _COPY_KEY))] = [_microseconds(_COPY_SECONDS[key[0]])]
            _write_cpu_cache(entries)
    _CPU_WORDS[key] = words
    return words


def timing_copies(candidate: "Candidate", sizes: Sequence[int]) -> int:
    """The vectors a timing of ``candidate`` on ``sizes`` runs, encoding and decoding,
    in quantizer vectors (a low-rank one counts ``LOW_RANK_COPY_COST``): its call
    overhead's two calls (``_least_calls``: the copies and twice as many, the first of
    them the least size's timing), then a call of the copies per other size."""
    copies = _copies(candidate)
    vectors = 2 * (3 * copies + copies * sum(1 for n in sizes if n != CPU_SIZES[0]))
    return vectors * (1 if candidate.rank is None else LOW_RANK_COPY_COST)


def _measured_keys(num_workers: int):
    """The measured candidates' timings (``measure_low_rank``): the key, words and
    copies of each kind, the low-rank ones first."""
    ranks, sizes = LOW_RANK_TIMED
    return (((num_workers, ("low rank",)), 2 * len(CPU_SIZES) * len(LOW_RANK),
             sum(timing_copies(BY_LABEL[f"psgd{r}"], sizes) for r in ranks)),
            ((num_workers, tuple(c.label for c in SPARSE)), 2 * len(CPU_SIZES) * len(SPARSE),
             sum(timing_copies(c, CPU_SIZES) for c in SPARSE)))


def measured_timing_s(num_workers: int, figures: Optional["Figures"] = None
                      ) -> Optional[float]:
    """The seconds ``measure_low_rank`` would spend timing the measured candidates that
    ``figures`` lack (all where None) on this worker now: none where this process or
    the disk keeps their timings, else the copies it would time at what a copy cost in
    the last timing on this machine; None where no timing on this machine says. (One
    idle process on 2 cores: 7 ms a copy for the quantizers, 2.2-2.3 s in all, and
    0.9 s for the low-rank ones' 128 and 0.45 s for top-k's 80.)"""
    cache = _read_cpu_cache() if _use_disk() else {}
    left = sum(copies for kind, (key, length, copies) in zip((LOW_RANK, SPARSE),
                                                             _measured_keys(num_workers))
               if (figures is None or not _timed_in(figures, kind))
               and _kept_words(key, length, cache) is None)
    if not left:
        return 0.0
    per_copy = _COPY_SECONDS.get(num_workers)
    if per_copy is None:
        kept = cache.get(_disk_key((num_workers, _COPY_KEY)))
        per_copy = kept[0] / 1e6 if _valid_words(kept, 1) else None
    return None if per_copy is None else left * per_copy


def timing_pays(saving_s: float, steps_left, timing_s) -> bool:
    """Whether timing the measured candidates may pay: ``saving_s`` (at most what they
    could save a step: what the gradients they may take cost now) over ``steps_left``
    steps at least ``timing_s`` (``measured_timing_s``). Unknown (None or NaN) steps or
    seconds: they are timed. A timing is kept on disk for later jobs, so one that a
    short job leaves out is taken by the first long enough for it to pay."""
    unknown = [v for v in (steps_left, timing_s) if v is None or not math.isfinite(v)]
    return bool(unknown) or saving_s * max(steps_left, 0.0) >= timing_s


def _write_cpu_cache(entries: Dict[str, List[int]]):
    """Adds ``entries`` (words by disk key) to the disk's timings, in one write
    (atomically: a reader never sees half a file; another process's write in between
    may lose its entries, which it measures again)."""
    path = cpu_cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cache = _read_cpu_cache()
        cache.update({key: list(words) for key, words in entries.items()})
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cpu.", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError as exc:
        logging.warning("tfgc: compressor='auto' could not keep its CPU timings in %s: %s",
                        path, exc)


def _cpu_words(candidates, num_workers: int) -> List[int]:
    key = (num_workers, tuple(c.label for c in candidates))

    def measure():
        words = []
        for candidate in candidates:
            for size in CPU_SIZES:
                words.extend(_microseconds(s) for s in _cpu_seconds(candidate, size,
                                                                    num_workers))
        return words

    return _cached_words(key, 2 * len(CPU_SIZES) * len(candidates), measure,
                         sum(timing_copies(c, CPU_SIZES) for c in candidates))


def _low_rank_words(num_workers: int) -> List[int]:
    """The low-rank candidates' words, as ``_cpu_words(LOW_RANK, num_workers)`` lays
    them out, from the codecs of ``LOW_RANK_TIMED`` alone: each size's time on the line
    through the two timed sizes, each rank's on the line through the two timed ranks."""
    key, length, copies = _measured_keys(num_workers)[0]

    def measure():
        ranks, sizes = LOW_RANK_TIMED
        timed = {(r, n): _cpu_seconds(BY_LABEL[f"psgd{r}"], n, num_workers)
                 for r in ranks for n in sizes}

        def between(x, x0, x1, y0, y1):
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

        def seconds(rank, n, k):  # k: 0 encoding, 1 decoding
            at = [between(n, *sizes, timed[(r, sizes[0])][k], timed[(r, sizes[1])][k])
                  for r in ranks]
            return between(rank, *ranks, *at)

        return [_microseconds(seconds(c.rank, n, k))
                for c in LOW_RANK for n in CPU_SIZES for k in (0, 1)]

    return _cached_words(key, length, measure, copies)


def measure(cross_device_ops, link_gbps: float, latency_ms: float) -> "Figures":
    """This worker's figures, then the slowest worker's of each (the same everywhere).

    The CPU timings are taken once per process (and cluster size) and kept, in the
    process and on disk (``cpu_cache_path``); the link is timed at every call. The
    low-rank candidates are left to ``measure_low_rank``: they are planned only once
    training has measured their error, and their graphs are ten times a quantizer's
    (``LOW_RANK_TIMED``). Runs eagerly (under
    ``init_scope``); every worker must call it at the same point.
    """
    n = cross_device_ops.group_size
    with tf.init_scope():
        words = list(_link_us(cross_device_ops, link_gbps)) + _cpu_words(CANDIDATES[1:], n)
        agreed = _slowest(cross_device_ops, words)
    return Figures.from_words(agreed, n, link_gbps, latency_ms)


def _timed_in(figures: "Figures", candidates) -> bool:
    """Whether ``figures`` hold every one of ``candidates``' CPU timings."""
    return all(c.label in figures.encode_us for c in candidates)


def measured(figures: "Figures") -> bool:
    """Whether ``figures`` hold the measured candidates' CPU timings."""
    return _timed_in(figures, MEASURED)


def measure_low_rank(cross_device_ops, figures: "Figures") -> "Figures":
    """``figures`` with the measured candidates' CPU timings added (the slowest worker's:
    the low-rank ones, then top-k), where it has none yet. Eager; every worker must
    call it at the same point."""
    words = []
    if not _timed_in(figures, LOW_RANK):
        words += _low_rank_words(figures.num_workers)
    if not _timed_in(figures, SPARSE):
        words += _cpu_words(SPARSE, figures.num_workers)
    if not words:
        return figures
    with tf.init_scope():
        agreed = _slowest(cross_device_ops, words)
    return Figures.from_words(figures.words() + agreed, figures.num_workers,
                              figures.link_gbps, figures.latency_ms)


def measure_link(cross_device_ops, figures: "Figures") -> "Figures":
    """``figures`` with the link measured again (every worker at once, as ``measure``).

    ``AutoPlanCallback`` does this at intervals' ends, so the probe is kept short:
    the three smallest sizes always, a larger one only where the current figures predict
    its all-reduce under ``REPROBE_S`` (the same sizes on every worker, since the
    figures are agreed). A size left out keeps its earlier time scaled as the largest
    size probed changed, unless that moved by more than ``REPROBE_MARGIN``, when every
    size is timed again; so an unchanged link gives the figures it gave before (a line
    through the two small sizes alone would not: on these machines it tilts, and the
    plan moved with it). At 100 Mbit/s the 4 MB all-reduce takes half a second, and
    with its warm-up and repeats the whole probe took 2.5 s an interval."""
    if figures.link_gbps or figures.num_workers < 2:
        return figures
    n, link = figures.num_workers, figures.link()
    sizes = [size for i, size in enumerate(LINK_SIZES)
             if i < 3 or link.time("allreduce", n, size) <= REPROBE_S]
    k = len(sizes)
    with tf.init_scope():
        agreed = _slowest(cross_device_ops, _link_us(cross_device_ops, 0.0, sizes))
        if k < len(LINK_SIZES):
            ratio = agreed[-1] / max(figures.link_us[k - 1], 1)
            if abs(math.log(max(ratio, 1e-9))) > math.log(1.0 + REPROBE_MARGIN):
                # The link moved: the whole probe, once, rather than figures scaled.
                agreed += _slowest(cross_device_ops,
                                   _link_us(cross_device_ops, 0.0, LINK_SIZES[k:]))
            else:
                agreed += [_microseconds(us * ratio / 1e6) for us in figures.link_us[k:]]
    return dataclasses.replace(figures, link_us=tuple(agreed))


def _link_us(cross_device_ops, link_gbps, sizes=LINK_SIZES):
    """The all-reduce probe's times in microseconds, for ``sizes`` bytes (zeros when the
    link is given)."""
    measured = cross_device_ops.group_size > 1 and not link_gbps
    return [_microseconds(cross_device_ops.time_all_reduce(
        size, LATENCY_REPEATS if size == LINK_SIZES[0] else REPEATS) if measured else 0.0)
            for size in sizes]


def _slowest(cross_device_ops, words):
    """Every worker's ``words`` all-gathered; the largest of each, as Python ints."""
    return [int(w) for w in np.max(cross_device_ops.gather_words(words), axis=0)]


def link_ratio(old: "Figures", new: "Figures", nbytes: int, num_workers: int) -> float:
    """The float32 all-reduce of ``nbytes`` on ``num_workers`` as ``new``'s link predicts
    it, over the same as ``old``'s does."""
    before, after = (f.link().time("allreduce", num_workers, nbytes) for f in (old, new))
    return after / max(before, 1e-12)


def link_changed(old: "Figures", new: "Figures", plan: "Plan", margin: float) -> bool:
    """Whether the float32 all-reduce of the planned gradients, as each link predicts
    it, moved by more than ``margin`` (relative) between ``old`` and ``new``."""
    nbytes = sum(e.dense_bytes for e in plan.entries)
    return abs(link_ratio(old, new, nbytes, plan.num_workers) - 1.0) > margin


def interval_norm(total_norm: float, squares: float, steps: float
                  ) -> Tuple[float, float, float]:
    """A gradient's interval as ``critical_layers`` compares it: (mean, noise, level).
    ``mean``: the norm of its mean over the interval's ``steps`` steps (``total_norm``:
    the norm of their sum); ``level``: the steps' spread, sqrt(v), v their variance
    summed over the entries, estimated from ``squares`` (the sum over the steps of each
    step's squared norm) as (squares - |sum|^2 / n) / (n - 1); ``noise``: what the
    mean's norm may carry of it, sqrt(v / n), the root-mean-square norm of the mean's
    deviation from the gradient's expectation where steps are independent. With fewer
    than two steps the spread is unknown: noise 0 (the norms' test as ACCORDION has
    it), level NaN."""
    n = float(steps)
    if not n > 0 or not math.isfinite(total_norm):
        return float("nan"), 0.0, float("nan")
    mean = total_norm / n
    if n < 2 or not math.isfinite(squares):
        return mean, 0.0, float("nan")
    level = math.sqrt(max(squares - total_norm * total_norm / n, 0.0) / (n - 1))
    return mean, level / math.sqrt(n), level


def _norm_parts(value) -> Tuple[float, float, float]:
    """A norm as ``critical_layers`` takes it: (mean, noise, level), (mean, noise)
    (level unknown) or a bare norm (noise 0)."""
    if isinstance(value, (tuple, list)):
        parts = [float(v) for v in value] + [float("nan")]
        return parts[0], parts[1], parts[2]
    return float(value), 0.0, float("nan")


def critical_layers(previous: Dict[str, object], current: Dict[str, object],
                    threshold: float, noise: float = 1.0) -> frozenset:
    """ACCORDION's test per layer: the norm of its gradient over the interval (here, of
    the interval's mean) moved by ``threshold`` or more (relative) since the previous
    interval; a layer without a previous norm (the first interval), or with a previous
    norm of 0 or not finite, is critical. Each norm is a (mean, noise, level) triple
    (``interval_norm``), or a bare norm (noise 0, level unknown).

    With ``noise`` above 0, a move of the mean no larger than ``noise`` times the two
    intervals' noises together, sqrt(noise_before^2 + noise_now^2), is not a change: the
    norm of a mean is within the norm of its noise of the norm of its expectation, and
    the two intervals' noises are independent. Over short intervals the mean of a
    stochastic gradient is mostly noise, whose norm is a single draw that moves by half
    from one interval to the next where the noise has few directions; the level (the
    steps' spread, an average over the interval's steps) holds still there. So where
    the noise could hide a move of the mean by ``threshold``, a move of the level by
    ``threshold`` or more counts instead: the noise falling as early training ends.
    (Where it could not, the mean's test decides alone: the spread of steps that only
    drift, as full-batch ones do, says nothing the mean does not.) ``noise`` 0:
    ACCORDION's bare test of the mean alone. Measured on the trainer's CNN and MLP on
    Fashion-MNIST, 3 seeds each, intervals of 25 steps of 128 examples
    (``benchmarks/regimes.py``): the bare test called some layer critical at 6 to 14
    of 31 interval ends, mostly where nothing but the draw moved; this one at 3 to 5:
    the first (early training), those after the learning rate's decay, and twice
    elsewhere."""
    return frozenset(critical_reasons(previous, current, threshold, noise))


# Why ``critical_reasons`` calls a gradient critical.
NO_PREVIOUS, MEAN_MOVED, SPREAD_MOVED = "no norm to compare", "the mean moved", \
    "the spread moved"


def critical_reasons(previous: Dict[str, object], current: Dict[str, object],
                     threshold: float, noise: float = 1.0) -> Dict[str, str]:
    """``critical_layers``'s gradients, each with why: ``NO_PREVIOUS`` (no previous
    norm, or one of 0 or not finite, or a norm now not finite), ``MEAN_MOVED`` (the
    mean's norm moved) or ``SPREAD_MOVED`` (the steps' spread did, where the noise hid
    the mean's)."""
    out = {}
    for name, value in current.items():
        norm, spread, level = _norm_parts(value)
        before = previous.get(name)
        if before is None:
            out[name] = NO_PREVIOUS
            continue
        before, spread_before, level_before = _norm_parts(before)
        if not before > 0 or not math.isfinite(before) or not math.isfinite(norm):
            out[name] = NO_PREVIOUS
            continue
        moved, hidden = abs(before - norm), noise * math.hypot(spread_before, spread)
        if moved / before >= threshold and moved > hidden:
            out[name] = MEAN_MOVED
        elif noise > 0 and hidden >= threshold * before and level_before > 0 \
                and math.isfinite(level_before) and math.isfinite(level) \
                and abs(level - level_before) / level_before >= threshold:
            out[name] = SPREAD_MOVED
    return out


def _no_lossier(went: Optional["Candidate"], candidate: "Candidate") -> bool:
    """Whether ``candidate`` (low rank or top-k) loses no more than ``went``, the
    candidate a held gradient went as (None: unknown, so none): low rank at its rank or
    more where it went low rank, top-k where it went top-k."""
    if went is None or went.error_key is None:
        return False
    if candidate.rank is None or went.rank is None:
        return candidate.label == went.label
    return candidate.rank >= went.rank


def learning_rate_fell(before: Optional[float], now: Optional[float],
                       threshold: float) -> bool:
    """ACCORDION's second rule (Agarwal et al., MLSys 2021: its code, at any fall of the
    learning rate between epochs, switches every layer to the lower compression until
    its next decision), as a test for schedules that fall a little every step: the
    rate fell by ``threshold`` or more (relative) since the previous interval's end,
    as the norms' test (``critical_layers``) asks of a gradient (any fall would make
    every interval of a cosine schedule critical). A step decay (a tenth) passes it; a
    cosine schedule does in its last few intervals, where the rate falls fastest
    relative to itself, and a slow exponential decay never. False where either rate is
    unknown (None, not finite) or the previous one is not positive; a rising rate (a
    warm-up) is not a fall."""
    if before is None or now is None:
        return False
    before, now = float(before), float(now)
    if not (math.isfinite(before) and math.isfinite(now)) or before <= 0:
        return False
    return (before - now) / before >= threshold


def _microseconds(seconds: float) -> int:
    return int(min(max(round(seconds * 1e6), 0), 2 ** 31 - 1))


@dataclasses.dataclass(frozen=True)
class Line:
    """y = a + b x, a and b at least 0."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


def fit(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """The least-squares line through the points, with a non-negative intercept and
    slope (noise on a fast link can tilt it either way)."""
    x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    b = float(np.sum((x - x.mean()) * (y - y.mean())) / np.sum((x - x.mean()) ** 2))
    b = max(b, 0.0)
    a = float(y.mean() - b * x.mean())
    if a < 0.0:
        a, b = 0.0, max(float(np.sum(x * y) / np.sum(x * x)), 0.0)
    return Line(a, b)


def link_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """The line through the link probe's first point (the smallest message: its time is
    the latency, bar a few bytes), its slope the least-squares one of the others about
    that point; neither part negative.

    Not a least-squares line through all of them: a token-bucket shaper lets the first
    bytes of every message through at once (its burst: 64 KB on the benchmarks' links,
    5 ms at 100 Mbit/s), so the large messages' line meets zero bytes below the
    latency, and the fitted intercept went toward zero (0.10 ms a hop at 100 Mbit/s on
    2 workers, against 1.3-2.6 ms at 1 and 10 Gbit/s on the same machine): the plan
    then split its gradients over more collectives than paid."""
    x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    dx, dy = x[1:] - x[0], y[1:] - y[0]
    b = max(float(np.sum(dx * dy) / np.sum(dx * dx)), 0.0)
    return Line(max(float(y[0] - b * x[0]), 0.0), b)


@dataclasses.dataclass(frozen=True)
class Figures:
    """The agreed measurements, in microseconds (``measure``), and the lines through them.

    ``link_us[i]``: the all-reduce of ``LINK_SIZES[i]`` bytes (zeros when not
    measured); ``encode_us[label][i]`` and ``decode_us[label][i]``: a vector of
    ``CPU_SIZES[i]`` elements.
    """

    num_workers: int
    link_us: Tuple[int, ...]
    encode_us: Dict[str, Tuple[int, ...]]
    decode_us: Dict[str, Tuple[int, ...]]
    link_gbps: float = 0.0
    latency_ms: float = 0.1

    @classmethod
    def from_words(cls, words: List[int], num_workers: int, link_gbps: float = 0.0,
                   latency_ms: float = 0.1) -> "Figures":
        m = len(CPU_SIZES)
        k = len(LINK_SIZES)
        if (len(words) - k) % (2 * m) and not (len(words) - len(EARLIER_LINK_SIZES)) % (2 * m):
            k = len(EARLIER_LINK_SIZES)
        link, rest = tuple(words[:k]), words[k:]
        encode, decode = {}, {}
        # Words stored before the low-rank candidates existed end after the others'.
        for j, candidate in enumerate(ALL[1:1 + len(rest) // (2 * m)]):
            block = rest[2 * m * j:2 * m * (j + 1)]
            encode[candidate.label] = tuple(block[0::2])
            decode[candidate.label] = tuple(block[1::2])
        return cls(num_workers, link, encode, decode, link_gbps, latency_ms)

    def words(self) -> List[int]:
        """The figures as ``from_words`` reads them (and ``measure`` agrees on them): the
        link's, then each candidate's encoding and decoding, size by size."""
        out = list(self.link_us)
        for candidate in ALL[1:]:
            if candidate.label not in self.encode_us:
                break
            for e, d in zip(self.encode_us[candidate.label], self.decode_us[candidate.label]):
                out += [e, d]
        return out

    def link(self) -> costmodel.AlphaBeta:
        """Seconds per hop and per byte a worker sends (``costmodel``): given, or from the
        line through the probe's all-reduce times against the bytes each worker sent
        (``link_line``), whose intercept is the latency of the all-reduce's 2(N-1)
        hops."""
        if self.link_gbps:
            return costmodel.AlphaBeta(self.latency_ms / 1e3, 8.0 / (self.link_gbps * 1e9))
        if self.num_workers < 2:
            return costmodel.AlphaBeta(0.0, 0.0)
        seconds = [us / 1e6 for us in self.link_us]
        if len(seconds) == len(EARLIER_LINK_SIZES):  # figures from before the small probe
            line = fit([ring_sent(s, self.num_workers) for s in EARLIER_LINK_SIZES], seconds)
        else:
            line = link_line([ring_sent(s, self.num_workers) for s in LINK_SIZES], seconds)
        return costmodel.AlphaBeta.from_allreduce(line.a, line.b, self.num_workers)

    def encode(self, label: str) -> Line:
        return fit(CPU_SIZES, [us / 1e6 for us in self.encode_us[label]])

    def decode(self, label: str) -> Line:
        return fit(CPU_SIZES, [us / 1e6 for us in self.decode_us[label]])

    def describe_link(self) -> str:
        link = self.link()
        rate = 8.0 / link.beta / 1e9 if link.beta > 0 else float("inf")
        source = "given" if self.link_gbps else "measured"
        return (f"link ({source}): {link.alpha * 1e3:.3f} ms per hop + bytes at {rate:.3g} "
                "Gbit/s per worker")

    def describe(self) -> str:
        return f"{self.describe_link()}; " + ", ".join(
            f"{label} {self.encode(label).b * 1e9:.2f}+{self.decode(label).b * 1e9:.2f} "
            "ns/element" for label in self.encode_us)


# -- the low-rank candidates' error -------------------------------------------------

def low_rank_errors(matrix: np.ndarray, ranks: Sequence[int] = RANKS,
                    seed: int = 0) -> Tuple[float, Dict[int, float]]:
    """``matrix``'s squared norm and, for each rank r, the relative error of its best
    rank-r approximation, 1 - (s_1^2 + ... + s_r^2) / ||M||^2 (s: its singular values).

    What PowerSGD's power iteration approaches (one iteration a step from a warm
    query); its error on a step is at least this. Large matrices take the top singular
    values from a randomized range finder (Halko, Martinsson & Tropp, SIAM Review 2011:
    8 extra columns and two power iterations), whose values are at most the true ones,
    so the errors it gives are at least the true ones. Deterministic in ``seed``. A
    matrix of zeros loses nothing; one that is not finite has no errors (``{}``). Rows
    and columns of zeros change no singular value, so they are left out first: an
    embedding table densified from a step's rows (65,536 x 128, a few hundred rows
    touched) is the matrix of those rows, whose values come exactly and at once.
    """
    a = np.asarray(matrix, np.float64)
    if a.ndim != 2:
        raise ValueError(f"low_rank_errors needs a matrix, got shape {a.shape}")
    total = float(np.sum(a * a))
    if not math.isfinite(total):
        return total, {}
    if total == 0.0:
        return total, {r: 0.0 for r in ranks}
    nonzero = a != 0
    a = a[np.any(nonzero, axis=1)][:, np.any(nonzero, axis=0)]
    k = max(ranks)
    small = min(a.shape)
    if small <= k + 8 or a.size <= (1 << 16):
        values = np.linalg.svd(a, compute_uv=False)
    else:
        if a.shape[0] < a.shape[1]:
            a = a.T
        rng = np.random.RandomState(seed)
        y = a @ rng.standard_normal((a.shape[1], k + 8))
        for _ in range(2):
            q, _ = np.linalg.qr(y)
            q, _ = np.linalg.qr(a.T @ q)
            y = a @ q
        q, _ = np.linalg.qr(y)
        values = np.linalg.svd(q.T @ a, compute_uv=False)
    captured = np.cumsum(values.astype(np.float64) ** 2)
    return total, {r: float(max(0.0, 1.0 - captured[min(r, len(captured)) - 1] / total))
                   for r in ranks}


def top_k_errors(gradient: np.ndarray, ratios: Sequence[float] = (TOPK_RATIO,)
                 ) -> Tuple[float, Dict[float, float]]:
    """``gradient``'s squared norm and, for each ratio, the relative error of keeping
    its k = ceil(ratio n) entries of largest magnitude (top-k's own k),
    1 - (their squares' sum) / ||g||^2: what one top-k step leaves in the residual.
    Zeros lose nothing; a gradient that is not finite has no errors (``{}``). Only
    the entries that are not zero are ranked (k still counts every entry): a table's
    untouched rows hold nothing to keep."""
    squares = np.square(np.asarray(gradient, np.float64).reshape(-1))
    total = float(np.sum(squares))
    if not math.isfinite(total):
        return total, {}
    if total == 0.0:
        return total, {r: 0.0 for r in ratios}
    n = squares.size
    squares = squares[squares > 0]
    out = {}
    for ratio in ratios:
        k = TopK(ratio=ratio).num_kept(tf.TensorShape([n]))
        if k >= squares.size:
            out[ratio] = 0.0  # every entry that holds anything is kept
            continue
        kept = float(np.sum(np.partition(squares, squares.size - k)[squares.size - k:]))
        out[ratio] = max(0.0, 1.0 - kept / total)
    return total, out


def measured_errors(gradient: np.ndarray, seed: int = 0
                    ) -> Optional[Tuple[float, Dict[object, float]]]:
    """What a measurement records of one gradient (alone): its squared norm and the
    relative error of every measured candidate, by ``Candidate.error_key`` (each rank
    of ``RANKS``, ``low_rank_errors`` of the gradient as PowerSGD's matrix; top-k's
    label, ``top_k_errors``); None where it is not finite."""
    x = np.asarray(gradient)
    shape = LOW_RANK[0].described.matrix_shape(tf.TensorShape(x.shape))
    sq, rel = low_rank_errors(x.reshape(shape), RANKS, seed=seed)
    if not rel:
        return None
    _, kept = top_k_errors(x, [c.described.inner.ratio for c in SPARSE])
    return sq, {**rel, **{c.label: kept[c.described.inner.ratio] for c in SPARSE}}


@dataclasses.dataclass(frozen=True)
class LowRank:
    """The low-rank candidates' measured errors and their budget (L-GreCo: Markov et al.,
    MLSys 2024).

    ``errors[name] = (squared norm, {key: relative error})`` for the gradients
    measured, by ``Candidate.error_key``: each rank's (``low_rank_errors`` of a recent
    local gradient, without any residual) and top-k's (``top_k_errors`` of the same). A
    plan's gradients sent as measured candidates may together lose at most what
    PowerSGD at ``rank`` on every measured gradient it can compress would: the sum of
    squared norm times relative error at that rank. The error feedback keeps what each
    step leaves out and sends it later, so that budget bounds how much is late, not
    lost; the quantizers' budget (``Auto.error``) bounds the others' lost variance
    apart.
    """

    rank: int
    errors: Dict[str, Tuple[float, Dict[int, float]]]
    # ``Auto.critical_rank``: None for its default, 0 for none.
    critical: Optional[int] = None
    # ``Auto.critical_error``: the most measured error a critical gradient may lose
    # low-rank.
    critical_error: float = math.inf

    @property
    def critical_rank(self) -> Optional[int]:
        """The least rank a gradient in a critical regime may take, None where it may
        not go low-rank at all: by default twice the budget's (ACCORDION's PowerSGD
        runs compress less there, at a higher rank, rather than not at all)."""
        if self.critical is None:
            return min(2 * self.rank, max(RANKS))
        return self.critical or None

    def budget(self, shapes: Dict[str, Sequence[int]]) -> float:
        """The budget for gradients of these ``shapes`` (by name): only measured ones
        that PowerSGD at ``rank`` would compress count."""
        compressor = BY_LABEL[f"psgd{self.rank}"].described
        return sum(sq * rel[self.rank] for name, (sq, rel) in sorted(self.errors.items())
                   if name in shapes and compressor.supports(tf.TensorShape(shapes[name]),
                                                             tf.float32))


# -- the plan's step, as training feels it ------------------------------------------

# Each plan that ran: (its predicted communication, its measured step, that step's
# standard error) in seconds. A line through two or more of them needs their
# predictions this far apart, as a share of the steps' mean, before its slope is trusted
# over the noise of a median step; and the slope is kept within these bounds.
PACE_SPREAD = 0.05
PACE_SCALE = (0.05, 2.0)
# A measured step's standard error is at least this share of it: two plans run in
# different stretches of training, whose steps differ by more than their own spread
# says (the data a step reads, the machine's other work).
PACE_DRIFT = 0.01
# A step's spread where nothing measured it (and a step whose error is not given has
# an error of this share of it): 1.4826 times the median absolute deviation of the
# steps stored in benchmarks/results (runs of 8 steps or more) was 4-10 % of their
# median step in most runs; the 90th percentile of each file's runs, 8.5-19 %.
PACE_PRIOR = 0.1
# The slopes the steps allow: this many standard errors either side of the fitted one
# (about 95 %). A change of plan must pay along the lines at both ends.
PACE_Z = 2.0
# Or it is a trial (``change_pays``): it pays twice at the fitted slope and loses
# nothing at this many standard errors either side of it (about 68 % between them).
TRIAL_Z = 1.0


@dataclasses.dataclass(frozen=True)
class Pace:
    """What a step of training costs under a plan, from the steps that ran
    (``pace_from``): ``compute_s`` seconds the plan does not change, plus ``scale``
    measured seconds per second of communication the plan predicts; and what a plan's
    low-rank error costs in steps: PowerSGD at the budget's rank on every measured
    matrix (a whole low-rank budget) needs ``low_rank_steps`` more of them, as a share,
    to reach the same accuracy (``Auto.low_rank_steps``), and a plan that uses a share
    u of the budget u times as many.

    ``seconds`` is then a plan's time to a given accuracy, per step of a plan that
    loses nothing: the planner minimises it (``make_plan``), so a low-rank plan must
    save more time a step than the steps it adds cost.

    ``others``: the paces at the ends of the slope's interval, where the steps measured
    it, and at the bend between them where there is one (``pace_from``); a change of
    plan must pay under each of them too (``change_pays``), so that two noisy steps do
    not swing the plan back and forth. ``near``: the same at ``TRIAL_Z`` standard
    errors, where a change that is a trial must lose nothing.
    """

    compute_s: float
    scale: float = 1.0
    low_rank_steps: float = 0.0
    others: Tuple["Pace", ...] = ()
    # The other sets' predicted communication in ``compute_s`` (``beside``), seconds.
    shared_s: float = 0.0
    near: Tuple["Pace", ...] = ()

    @property
    def shared_compute_s(self) -> float:
        """The seconds of ``compute_s`` that are the other sets' communication."""
        return self.scale * self.shared_s

    def seconds(self, comm_s: float, low_rank_share: float) -> float:
        return ((self.compute_s + self.scale * comm_s)
                * (1.0 + self.low_rank_steps * low_rank_share))

    @property
    def measured_slope(self) -> bool:
        """Whether the scale is a measured slope with an interval (``others``)."""
        return bool(self.others)

    def beside(self, others_s: float) -> "Pace":
        """This pace for one set of gradients among several a step reduces (a GAN's
        two optimizers): ``others_s`` seconds of the other sets' predicted
        communication are part of each step it prices, so they join its compute (at
        each line's own scale). A pace fitted to whole steps against every set's
        predicted communication (``AutoPlanner``) then prices one set's plan with the
        others' as they are."""
        if not others_s:
            return self
        return dataclasses.replace(
            self, compute_s=self.compute_s + self.scale * others_s,
            shared_s=self.shared_s + others_s,
            others=tuple(p.beside(others_s) for p in self.others),
            near=tuple(p.beside(others_s) for p in self.near))


def step_error(point: Tuple[float, ...]) -> float:
    """The standard error of a timed plan's step (a ``pace_from`` point): its own where
    given and finite, else ``PACE_PRIOR`` of the step; at least ``PACE_DRIFT`` of it
    (added in quadrature)."""
    t = float(point[1])
    se = float(point[2]) if len(point) > 2 and point[2] is not None else float("nan")
    if not (math.isfinite(se) and se >= 0):
        se = PACE_PRIOR * t
    return math.hypot(se, PACE_DRIFT * t)


def pace_from(points: Sequence[Tuple[float, ...]], low_rank_steps: float) -> Optional[Pace]:
    """The ``Pace`` of the plans that ran: ``points`` of (predicted communication,
    measured median step[, its standard error]), seconds, one per plan. A step whose
    error is not given (or not finite) has ``PACE_PRIOR`` of it; each error is at least
    ``PACE_DRIFT`` of its step (added in quadrature), and each point weighs the
    inverse of its error squared.

    One plan (or predictions too close to tell apart): the prediction is taken as it is
    (scale 1), unless the step is shorter than it, and the rest of the step is compute.
    Plans whose predictions differ: the weighted least-squares line through them, its
    slope within ``PACE_SCALE`` and its compute at least 0; where that line passes
    below the origin, the line through the origin instead. ``others`` then holds the
    lines at the slope's ends of ``PACE_Z`` standard errors (the slope's error is
    1 / sqrt(sum of w (x - mean x)^2), x the predictions, or 1 / sqrt(sum of w x^2)
    through the origin; times sqrt(chi^2 / (n - 2)) where three or more plans scatter
    about the line more than their errors say), through the points' weighted mean
    (their compute at least 0), and the line whose compute reaches 0 where that falls
    between the ends (a change's gain bends there). Where those ends span all of
    ``PACE_SCALE``, the steps' noise swamps the spread of their predictions and they
    say nothing of the slope: the plans count as one, and the slope is not measured.
    (Weighed at both bounds, every change that loses low rank was weighed as if
    communication were nearly free: the encoder at 1 Gbit/s kept a plan of 180-195 ms a
    step, rank 4 and its table as rows, over rank 2 with the table summed, 137-154 ms,
    which saved 73 ms at the fitted slope of 2 and 1.8 ms at 0.05.) None without
    points."""
    kept = []
    for point in points:
        c, t = float(point[0]), float(point[1])
        if math.isfinite(c) and math.isfinite(t) and c >= 0 and t > 0:
            kept.append((c, t, step_error(point)))
    if not kept:
        return None
    lrs = float(low_rank_steps)
    comm = np.array([c for c, _, _ in kept])
    step = np.array([t for _, t, _ in kept])
    weight = 1.0 / np.array([e for _, _, e in kept]) ** 2
    x, y = float(np.average(comm, weights=weight)), float(np.average(step, weights=weight))

    def bounded(scale):
        return min(max(scale, PACE_SCALE[0]), PACE_SCALE[1])

    def scatter(fitted):
        """The Birge ratio: how much more the points scatter about the line than
        their errors say (at least 1; 1 for two points)."""
        if len(kept) < 3:
            return 1.0
        chi2 = float(np.sum(weight * (step - fitted) ** 2))
        return max(1.0, math.sqrt(chi2 / (len(kept) - 2)))

    def as_one():
        """The slope where the plans count as one: the prediction as it is, unless the
        step is shorter than it."""
        return y / x if x > y else 1.0

    def informs(centre, half):
        """Whether the slope's interval leaves out some of ``PACE_SCALE``: one that
        spans it all says nothing the bounds do not."""
        return centre - half > PACE_SCALE[0] or centre + half < PACE_SCALE[1]

    measured = len(kept) > 1 and bool(np.ptp(comm) > PACE_SPREAD * step.mean())
    if measured:
        sxx = float(np.sum(weight * (comm - x) ** 2))
        centre = float(np.sum(weight * (comm - x) * (step - y))) / sxx
        half = PACE_Z / math.sqrt(sxx) * scatter(y + centre * (comm - x))
        measured = informs(centre, half)
    if not measured:
        centre = as_one()
    scale = bounded(centre)
    compute = y - scale * x
    origin = compute < 0.0
    if origin:
        # The line passes below the origin: communication alone, through the points.
        sww = float(np.sum(weight * comm * comm))
        centre = float(np.sum(weight * comm * step)) / max(sww, 1e-30)
        scale, compute = bounded(centre), 0.0
        if measured:
            half = PACE_Z / math.sqrt(max(sww, 1e-30)) * scatter(centre * comm)
            if not informs(centre, half):
                measured, origin = False, False
                scale = bounded(as_one())
                compute = max(y - scale * x, 0.0)

    def line(s):
        return Pace(0.0 if origin else max(y - s * x, 0.0), s, lrs)

    def lines(reach):
        """The lines at the ends of ``reach`` either side of the fitted slope, and at
        the bend between them where there is one."""
        ends = (bounded(centre - reach), bounded(centre + reach))
        found = tuple(line(s) for s in ends)
        if compute > 0.0 and x > 0.0 and ends[0] < y / x < ends[1]:
            found += (line(y / x),)
        return found

    if not measured:
        return Pace(compute, scale, lrs)
    return Pace(compute, scale, lrs, lines(half), near=lines(half * TRIAL_Z / PACE_Z))


# -- choosing -----------------------------------------------------------------------

def cpu_seconds(figures: Figures, candidate: Candidate, path: str, n: int) -> float:
    """The encodings and decodings ``path`` runs for a gradient of ``n`` elements
    (``costmodel.codec_calls``: one of each on the all-reduce, one encoding and a
    fused sum of the N payloads on the all-gather, a call per chunk on the
    reduce-scatter), each call a measured line."""
    if candidate.spec is None:
        return 0.0
    return costmodel.codec_seconds(path, figures.num_workers, n,
                                   figures.encode(candidate.label),
                                   figures.decode(candidate.label))


def sent_bytes(candidate: Candidate, path: str, shape, dtype, num_workers: int) -> int:
    """Bytes one worker sends per step for one gradient under ``candidate``."""
    if num_workers < 2:
        return 0
    n = int(np.prod(shape, dtype=np.int64))
    if candidate.spec is None:
        return int(ring_sent(n * tf.as_dtype(dtype).size, num_workers))
    if path == "allreduce":
        return int(ring_sent(n * 2, num_workers))  # the casts: 16 bits per element
    if path == "low_rank":
        # Two rings: P (rows x r) with the control words, then Q (cols x r).
        rows, cols = candidate.described.matrix_shape(tf.TensorShape(shape))
        factors = candidate.rank * (rows + cols) * tf.as_dtype(dtype).size
        return int(ring_sent(factors + 4 * guard.CONTROL_WORDS, num_workers))
    return auto_paths.sent_bytes(path, candidate.described,
                                 [(tf.TensorShape(shape), tf.as_dtype(dtype))], num_workers)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One gradient's line of the plan."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    label: str
    path: str
    dense_bytes: int
    sent_bytes: int
    cpu_s: float
    wire_s: float
    error: float  # the candidate's relative variance bound on this gradient
    reason: str = ""  # for float32: why; in a plan set by hand, "pinned" (or why not)
    critical: bool = False  # in a critical regime: candidates of bf16's bound at most

    @property
    def candidate(self) -> Candidate:
        return BY_LABEL[self.label]


@dataclasses.dataclass(frozen=True)
class Table:
    """An embedding table's line of the plan (``plan_tables``): its gradient as the rows
    a step touched (``embeddings.ROWS``, all-gathered in the quantizer ``label``; fp32:
    the stock gather) or summed into a dense gradient that the plan's entries send
    (``dense``; ``label`` is then what its rows would go as, which bounds its error).
    ``place``: its index among the tables, in the gradients' order."""

    place: int
    name: str
    shape: Tuple[int, ...]
    dtype: str
    dense: bool
    rows: int = 0  # the most distinct rows a worker sent in a recent step; 0: not counted
    tokens: int = 0  # the most rows with repeats (the stock gather sends these)
    label: str = ""
    sent_bytes: int = 0
    cpu_s: float = 0.0  # rows: their codec calls; dense: the densified table's passes
    wire_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every planned gradient is sent as, and what the model predicted."""

    entries: Tuple[Entry, ...]
    error_budget: float
    num_workers: int
    link: costmodel.AlphaBeta
    figures: Figures
    lam: float = 0.0
    # The low-rank candidates' budget (``LowRank.budget``; 0: none measured) and the
    # error the plan's low-rank gradients use of it.
    low_rank_budget: float = 0.0
    low_rank_error: float = 0.0
    # How the steps that ran weigh the plan (``Pace``; None: by its predicted step alone).
    pace: Optional[Pace] = None
    # The embedding tables (``plan_tables``); a dense one is among the entries too.
    tables: Tuple[Table, ...] = ()

    @property
    def rows_tables(self) -> Tuple[Table, ...]:
        return tuple(t for t in self.tables if not t.dense)

    @property
    def dense_places(self) -> frozenset:
        """The places (among the traced tables) of the tables sent dense."""
        return frozenset(t.place for t in self.tables if t.dense)

    @property
    def slope_measured(self) -> bool:
        """Whether the steps that ran measured its pace's slope (``Pace.measured_slope``)."""
        return self.pace is not None and self.pace.measured_slope

    @property
    def low_rank_share(self) -> float:
        """The share of the low-rank budget the plan's low-rank gradients use."""
        return self.low_rank_error / self.low_rank_budget if self.low_rank_budget else 0.0

    @property
    def mean_error(self) -> float:
        """The quantizers' budget in use: the mean over the planned elements of each
        gradient's bound (a low-rank gradient's error counts in its own budget, a dense
        embedding table's in none: ``plan_tables``)."""
        tables = {t.name for t in self.tables if t.dense}
        entries = [e for e in self.entries if e.name not in tables]
        total = sum(int(np.prod(e.shape)) for e in entries)
        if not total:
            return 0.0
        return sum(e.error * int(np.prod(e.shape)) for e in entries
                   if e.candidate.error_key is None) / total

    def key(self) -> str:
        """One line that names the plan: the compression state's compressor key."""
        return "auto:" + ";".join([f"{e.name}={e.label}@{e.path}" for e in self.entries]
                                  + [f"{t.name}=rows:{t.label}" for t in self.rows_tables])

    def digest(self) -> int:
        """A 31-bit checksum of the plan (workers compare theirs)."""
        return zlib.crc32(self.key().encode()) & 0x7FFFFFFF

    def predicted(self) -> Dict[str, float]:
        """Seconds per step the model predicts for the planned gradients: the plan's
        (CPU, wire, and the latency of each compressed group's collectives, one bucket
        each) and the wire and latency of all of them as float32 (the embedding tables
        sent as rows: the stock gather's, float32 rows)."""
        groups = {e.label: e.path for e in self.entries if e.label != "fp32"}
        rows = self.rows_tables
        plan = {"cpu_s": sum(e.cpu_s for e in self.entries) + sum(t.cpu_s for t in self.tables),
                "wire_s": sum(e.wire_s for e in self.entries) + sum(t.wire_s for t in rows),
                "latency_s": sum(self.link.latency(path, self.num_workers)
                                 for path in groups.values())
                # The rows: their counts, then the blocks (two all-gathers).
                + (2 * self.link.latency("allgather", self.num_workers) if rows else 0.0)}
        # All as float32: the entries on one all-reduce, and the tables sent as rows as
        # the stock gather sends them (every occurrence's values and index, in two
        # all-gathers, as the plan's own rows are priced).
        fp32 = sum(e.dense_bytes for e in self.entries)
        stock_rows = sum(rows_table(t, None, self.figures).wire_s for t in rows)
        return {**plan,
                "fp32_wire_s": self.link.wire("allreduce", self.num_workers, fp32) + stock_rows,
                "fp32_latency_s": self.link.latency("allreduce", self.num_workers)
                + (2 * self.link.latency("allgather", self.num_workers) if rows else 0.0)}

    def step_seconds(self) -> float:
        """The predicted seconds per step of the planned gradients: CPU, wire, latency."""
        p = self.predicted()
        return p["cpu_s"] + p["wire_s"] + p["latency_s"]

    def paced_seconds(self, pace: Optional[Pace] = None) -> float:
        """What the planner minimises: the step's seconds weighed by the steps its
        low-rank error adds (``Pace.seconds``; ``pace``, or the plan's own), or,
        without a pace, ``step_seconds``."""
        pace = pace or self.pace
        if pace is None:
            return self.step_seconds()
        return pace.seconds(self.step_seconds(), self.low_rank_share)

    def as_dicts(self) -> List[dict]:
        return [dataclasses.asdict(e) for e in self.entries]

    def table(self) -> str:
        """The plan as a text table, one line per gradient."""
        head = (f"tfgc: compressor='auto' plan for {len(self.entries)} gradients on "
                f"{self.num_workers} workers (error budget {self.error_budget:g}, mean bound "
                f"{self.mean_error:.3g}"
                + (f"; low-rank and top-k error {self.low_rank_error:.3g} of their budget "
                   f"{self.low_rank_budget:.3g} ({self.low_rank_share:.0%}; squared norms "
                   "left out, of the last measured gradients)" if self.low_rank_budget else "")
                + f"); {self.figures.describe()}")
        rows = [("variable", "shape", "as", "path", "dense", "sent", "cpu ms", "wire ms")]
        for e in self.entries:
            rows.append((e.name, "x".join(map(str, e.shape)) or "()", e.label, e.path,
                         _size(e.dense_bytes), _size(e.sent_bytes), f"{e.cpu_s * 1e3:.2f}",
                         f"{e.wire_s * 1e3:.2f}"))
        for t in self.tables:
            dense_bytes = int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size
            counted = f", {t.rows} rows" if t.rows else ", rows not counted yet"
            rows.append((t.name, "x".join(map(str, t.shape)) + counted,
                         "dense table" if t.dense else f"rows {t.label}",
                         "(above)" if t.dense else "allgather", _size(dense_bytes),
                         "" if t.dense else _size(t.sent_bytes), f"{t.cpu_s * 1e3:.2f}",
                         "" if t.dense else f"{t.wire_s * 1e3:.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        p = self.predicted()
        tail = (f"predicted per step: cpu {p['cpu_s'] * 1e3:.1f} ms + wire "
                f"{p['wire_s'] * 1e3:.1f} ms + latency {p['latency_s'] * 1e3:.1f} ms; "
                f"all float32: wire {p['fp32_wire_s'] * 1e3:.1f} ms")
        if self.pace is not None:
            pace = self.pace
            shared = (f" (of which {pace.shared_compute_s * 1e3:.1f} ms the step's "
                      f"other sets' communication)" if pace.shared_s else "")
            tail += (f"\nweighed by the steps that ran: compute {pace.compute_s * 1e3:.1f} ms"
                     f"{shared} + {pace.scale:.2f} x the predicted communication, "
                     f"{pace.low_rank_steps * self.low_rank_share:.1%} more steps for its "
                     f"low-rank error: {self.paced_seconds() * 1e3:.1f} ms a step")
        return "\n".join([head] + lines + [tail])


@dataclasses.dataclass(frozen=True)
class Joint:
    """The plans of the sets of gradients a step reduces together (a GAN's two
    optimizers: ``AutoPlanner``'s layouts that ran), weighed as one plan by
    ``prefer_timed`` and ``timed_seconds``: a timed step holds the runs of all of them,
    so plans that ran beside each other are timed only as a whole.

    ``pace`` is the line through whole steps against all their predicted communication
    (``pace_from`` over the steps they ran together), so none of it is another set's
    (``Pace.shared_s`` 0). Its communication is the sum of the plans', and its
    low-rank share the largest of theirs (each of its own budget): the models a step
    trains reach their accuracy together, at the pace of the one whose updates lose
    most (``benchmarks/network.py``'s pins count a step's low-rank steps so too)."""

    plans: Tuple[Plan, ...]
    pace: Optional[Pace] = None

    def key(self) -> str:
        """The plans' keys, one per line, in the sets' order."""
        return "\n".join(plan.key() for plan in self.plans)

    def step_seconds(self) -> float:
        return sum(plan.step_seconds() for plan in self.plans)

    @property
    def low_rank_share(self) -> float:
        return max((plan.low_rank_share for plan in self.plans), default=0.0)

    # Weighed as a plan is, from the step, share and pace above.
    paced_seconds = Plan.paced_seconds


def _size(nbytes: int) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _cost(o) -> float:
    """An option's seconds, and the price of its low-rank error (``make_plan``)."""
    return o["cpu"] + o["wire"] + o["pen"]


def _lagrangian(pick, mass, budget):
    """The smallest multiplier whose choice keeps within the budget (bisection), and
    that choice. The choice at a large enough multiplier is the least error of every
    gradient, so the search ends."""
    hi = 1.0
    for _ in range(200):
        if mass(pick(hi)) <= budget:
            break
        hi *= 2.0
    lo = 0.0
    for _ in range(64):
        mid = (lo + hi) / 2.0
        if mass(pick(mid)) <= budget:
            hi = mid
        else:
            lo = mid
    return hi, pick(hi)


def _fill(choice, options, left):
    """Spends what the Lagrangian choice left of the budget: gradients whose time saved
    per error added is the same switch together there (a model of equal layers), so it
    can stop short. Moves one gradient at a time to a faster option that still fits,
    the most time saved per error first."""
    choice = list(choice)
    while True:
        best = None
        for i, mine in enumerate(options):
            current = choice[i]
            now = _cost(current)
            for o in mine:
                saved = now - _cost(o)
                added = o["mass"] - current["mass"]
                if saved <= 0 or added <= 0 or added > left:
                    continue
                rank = (saved / added, saved, -i, -o["order"])
                if best is None or rank > best[0]:
                    best = (rank, i, o, added)
        if best is None:
            return choice
        _, i, o, added = best
        choice[i] = o
        left -= added


def _knapsack(options, budget):
    """The fastest choice whose error fits the budget, by dynamic programming over the
    budget cut into ``bins`` (L-GreCo's program): each option's error rounded up to
    whole bins, so what it returns always fits. Finds the exchanges the greedy
    ``_fill`` cannot make (4 bits moved from a small gradient to a large one while the
    small one takes 8). None when nothing fits."""
    bins = max(4096, 32 * len(options))

    def width(o):  # the option's error in bins, rounded up
        return min(int(math.ceil(o["mass"] / budget * bins - 1e-9)), bins) if o["mass"] > 0 else 0

    best = np.zeros(bins + 1)  # best[b]: least time with b bins of error used
    best[1:] = np.inf
    picks = []
    for mine in options:
        new = np.full(bins + 1, np.inf)
        pick = np.full(bins + 1, -1, np.int32)
        for k, o in enumerate(mine):  # from the least error: ties keep the first
            if o["mass"] > budget:
                continue
            w = width(o)
            shifted = np.full(bins + 1, np.inf)
            shifted[w:] = best[:bins + 1 - w] + _cost(o)
            better = shifted < new
            new[better], pick[better] = shifted[better], k
        best = new
        picks.append(pick)
    if not np.isfinite(best).any():
        return None
    b = int(np.argmin(best))
    choice = []
    for mine, pick in zip(reversed(options), reversed(picks)):
        o = mine[int(pick[b])]
        choice.append(o)
        b -= width(o)
    return choice[::-1]


def _step_seconds(choice, link, num_workers, cost=lambda o: o["cpu"] + o["wire"]) -> float:
    """A choice's predicted seconds per step, as ``Plan.step_seconds`` counts them: each
    option's ``cost`` (its CPU and wire time), and the latency of each compressed group's
    path."""
    used = {o["candidate"].label: o["path"] for o in choice if o["candidate"].spec is not None}
    return (sum(cost(o) for o in choice)
            + sum(link.latency(path, num_workers) for path in used.values()))


def _consolidate(choice, options, budget, link, num_workers, shared_limit=1.0):
    """Merges a candidate's group into another where the latency of its own collectives
    costs more than the group saves: the per-gradient choice does not see that a
    candidate chosen for one small gradient adds its path's hops to the step.
    Float32 gradients join the dense all-reduce that the biases take anyway, so they
    add none. Moves a whole group at a time, the move that saves the most first; none
    loses more of the low-rank budget than the choice did, or than ``shared_limit`` of it
    outside the dense tables (``make_plan``'s)."""
    choice = list(choice)

    def shared(c):
        return sum(o["charged"] for o in c)

    def step_time(c):  # the low-rank error's price included
        return _step_seconds(c, link, num_workers, _cost)

    while True:
        now = step_time(choice)
        used = [c.label for c in ALL[1:]
                if any(o["candidate"].label == c.label for o in choice)]
        best = None
        for label in used:
            for target in ["fp32"] + used:
                if target == label:
                    continue
                moved = list(choice)
                for i, o in enumerate(choice):
                    if o["candidate"].label == label:
                        alt = [x for x in options[i] if x["candidate"].label == target]
                        moved[i] = alt[0] if alt else None
                if any(o is None for o in moved) or sum(o["mass"] for o in moved) > budget \
                        or sum(o["lr"] for o in moved) > max(1.0, sum(o["lr"] for o in choice)) \
                        or shared(moved) > max(shared_limit, shared(choice)) + 1e-12:
                    continue
                saved = now - step_time(moved)
                if saved > 0 and (best is None or saved > best[0]):
                    best = (saved, moved)
        if best is None:
            return choice
        choice = best[1]


def change_pays(kept: Optional[Plan], new: Plan, min_gain_s: float,
                trial_share: float = 0.0) -> bool:
    """Whether to take ``new`` over the current plan, ``kept`` (the current choice priced
    anew by ``make_plan(..., only=...)``; None where the regimes or budgets now rule it
    out). Plans are compared as the planner chose them (``Plan.paced_seconds``), under
    the new plan's pace and, where the steps measured its slope, under the paces the
    slope's interval allows too (``least_gain``). ``new`` is taken where it saves at
    least ``min_gain_s`` seconds a step under each of them (what changing costs spread
    over the steps the new plan would run), or ``UNMEASURED_CHANGES`` times that where
    the steps have not measured the pace's slope (``required_gain``).

    Or as a trial (``is_trial``): where the slope is measured and the change pays
    ``UNMEASURED_CHANGES`` times ``min_gain_s`` at the fitted slope, with what it
    would lose over its trial at the worst pace (``trial_share`` of the steps it is
    priced over: ``trial_gain``), and loses nothing at ``TRIAL_Z`` standard errors of
    it, though it may at ``PACE_Z``. Its own steps then say whether it is faster, and
    ``prefer_timed`` goes back to the plan before it where they say it is not; so it
    pays for the change back, as a change does before a slope is measured. (Asked to
    pay at every slope the steps allow, the GAN at 1 Gbit/s kept a plan that ran 89 ms
    a step, where a change it weighed saved 22.9 ms at the fitted slope and lost
    2.5 ms at the interval's end: PowerSGD on every matrix ran 40 ms.)"""
    if kept is None:
        return True
    return bool(least_gain(kept, new) >= required_gain(new, min_gain_s)
                or is_trial(kept, new, min_gain_s, trial_share))


# A change of plan that only the link probe's prediction says pays (no slope measured
# yet: one plan timed, or predictions too close to tell apart) is a trial: where its
# steps say otherwise, the plan timed before it is taken back (``prefer_timed``), a
# second retrace. So it must pay for both. On 4 workers sharing 2 cores the probe
# priced the CNN's float32 all-reduce at 15.6 ms where the steps showed 2-4 ms, and
# changes that saved 1-3 ms a step by the probe cost their retraces and a way back
# (docs/results.md, "The CNN on the 10 Gbit/s link").
UNMEASURED_CHANGES = 2


def required_gain(new: Plan, min_gain_s: float) -> float:
    """What ``new`` must save a step to be taken (``change_pays``): ``min_gain_s``, or
    ``UNMEASURED_CHANGES`` times it where its pace has no measured slope."""
    return min_gain_s * (1 if new.slope_measured else UNMEASURED_CHANGES)


def _gains(kept: Plan, new: Plan, paces) -> List[float]:
    return [kept.paced_seconds(p) - new.paced_seconds(p) for p in paces]


def fitted_gain(kept: Plan, new: Plan) -> float:
    """What ``new`` saves a step over ``kept`` under its own pace (the fitted slope)."""
    return float(_gains(kept, new, [new.pace])[0])


def least_gain(kept: Plan, new: Plan, near: bool = False) -> float:
    """The least that ``new`` saves a step over ``kept`` under its pace and the paces
    the measured steps allow (``Pace.others``; ``near``: those at ``TRIAL_Z`` standard
    errors, ``Pace.near``): the gain is linear in the slope but for a bend where the
    line's compute reaches 0, so the interval's ends and that bend bound it."""
    pace = new.pace
    paces = [pace] + list(() if pace is None else pace.near if near else pace.others)
    return float(min(_gains(kept, new, paces)))


def is_trial(kept: Plan, new: Plan, min_gain_s: float, trial_share: float = 0.0) -> bool:
    """Whether ``new`` is taken over ``kept`` as a trial (``change_pays``): a measured
    slope, ``trial_gain`` saved a step at it, and nothing lost at ``TRIAL_Z`` standard
    errors either side."""
    if not new.slope_measured:
        return False
    return bool(fitted_gain(kept, new) >= trial_gain(kept, new, min_gain_s, trial_share)
                and least_gain(kept, new, near=True) >= 0.0)


def trial_gain(kept: Plan, new: Plan, min_gain_s: float, trial_share: float = 0.0) -> float:
    """What ``new`` must save a step at the fitted slope to be a trial (``is_trial``):
    ``UNMEASURED_CHANGES`` times ``min_gain_s`` (the change and the way back), and
    ``trial_share`` of what it would lose a step at the worst pace the steps allow
    (``least_gain``, where negative). ``trial_share``: the share of the steps that
    ``min_gain_s`` spreads a change over (``trial_share_of``) that a trial runs before
    its own steps are weighed; a wrong one runs them all at its own pace."""
    return (UNMEASURED_CHANGES * min_gain_s
            + min(trial_share, 1.0) * max(-least_gain(kept, new), 0.0))


def trial_share_of(trial_steps: Optional[float], steps_left: Optional[float]) -> float:
    """The share of a change's steps that its trial runs (``trial_gain``): ``trial_steps``
    (those before the planner weighs the trial's own steps: ``AutoPlanCallback``'s
    interval; None or 0: not priced) over the steps a change pays over, the fit's
    ``steps_left`` or, where fewer or unknown (None), the trial's own."""
    if not trial_steps or not math.isfinite(trial_steps):
        return 0.0
    left = steps_left if steps_left is not None and math.isfinite(steps_left) else 0.0
    return float(trial_steps / max(trial_steps, left))


def timed_seconds(plan: Plan, point: Tuple[float, ...],
                  pace: Optional[Pace] = None) -> Tuple[float, float]:
    """``plan``'s seconds as the planner weighs them (``Plan.paced_seconds``), from the
    step it ran at (``point``, as ``pace_from`` takes it: the step's predicted
    communication then, the measured median step, its error) rather than from the
    pace's line (``pace``, or the plan's own), and their standard error
    (``step_error``). The step is moved along the line's slope by what the step's
    communication is predicted to be now (this plan's, priced under the current
    figures, and the other sets': ``Pace.beside``), then weighed by the steps the
    plan's low-rank error adds."""
    pace = pace or plan.pace
    then, step = float(point[0]), float(point[1])
    moved = step + pace.scale * (plan.step_seconds() + pace.shared_s - then)
    weight = 1.0 + pace.low_rank_steps * plan.low_rank_share
    return max(moved, 0.0) * weight, step_error(point) * weight


def prefer_timed(new: Plan, kept: Optional[Plan], timed: Dict[str, Tuple[Plan, tuple]],
                 min_gain_s: float = 0.0) -> Optional[Plan]:
    """Measured steps over the model's prediction: the plan to take instead of ``new``
    (the planner's choice) given ``timed``, the plans that ran (by key: that plan
    priced now, under the current regimes and budgets, and its ``pace_from`` point),
    or None to weigh ``new`` against ``kept`` by their predictions (``change_pays``).

    ``kept`` is the current plan priced now (None where the regimes or budgets rule it
    out). Each timed plan costs what its own step says (``timed_seconds``), ``new``
    what its step says where it ran, else its prediction. Where that prediction beats
    every timed plan, or ``kept`` was not timed (no step given), None: ``new`` is
    tried. Where ``kept`` is None, a plan must be left: the cheapest timed plan, or
    None where that is ``new``. Otherwise ``kept`` gives way to the cheapest of the
    timed plans that save more than ``min_gain_s`` a step and more than ``PACE_Z``
    standard errors of the difference, under the pace and each pace its slope's
    interval allows (as ``least_gain``: a step moved along the line carries the
    slope's doubt); else it stays. So a plan that ran slower than one timed before
    gives way to it, and is not tried again while the timed steps stand, and a lucky
    step alone does not move it."""
    if new.pace is None or not timed or (kept is not None and kept.key() not in timed):
        return None
    costs = {key: timed_seconds(plan, point) for key, (plan, point) in timed.items()}
    best = min(costs, key=lambda key: (costs[key][0], key))
    if new.key() not in costs and new.paced_seconds() < costs[best][0]:
        return None
    if kept is None:
        return None if best == new.key() else timed[best][0]
    paces = [new.pace] + list(new.pace.others)

    def saves(key):
        """The least ``key`` saves over ``kept`` under any of ``paces``."""
        return min(timed_seconds(kept, timed[kept.key()][1], p)[0]
                   - timed_seconds(timed[key][0], timed[key][1], p)[0] for p in paces)

    stay_se = costs[kept.key()][1]
    better = [key for key in costs if key != kept.key()
              and saves(key) > max(min_gain_s, PACE_Z * math.hypot(stay_se, costs[key][1]))]
    if not better:
        return kept
    return timed[min(better, key=lambda key: (costs[key][0], key))][0]


def make_plan(gradients: Sequence[Tuple[str, Sequence[int], str]], figures: Figures,
              error_budget: float, critical=(), critical_bound: float = CRITICAL_BOUND,
              low_rank: Optional[LowRank] = None,
              only: Optional[Dict[str, str]] = None,
              pace: Optional[Pace] = None,
              capped: Optional[Dict[str, float]] = None,
              forced: bool = False,
              held: Optional[Dict[str, str]] = None,
              budget_of: Optional[Sequence[Tuple[str, Sequence[int], str]]] = None
              ) -> Optional[Plan]:
    """The plan for ``gradients`` (name, static shape, dtype name), in their order.

    Every candidate's cost and error for every gradient, then the Lagrangian choice
    under the budget, and groups merged where their own collectives cost more than they
    save (see the module docstring). Gradients named in ``critical`` (in a critical
    regime of training, ``CompressedAllReduce.adapt``) take only candidates whose bound
    is at most ``critical_bound`` (bf16's), or low rank at ``low_rank.critical_rank`` or
    more (where it has one) that loses at most ``low_rank.critical_error`` of it. With
    ``low_rank``, the gradients it measured may also go low-rank, within its
    budget: a second multiplier prices their error (bisection, as for the first), and
    the plan is the fastest at the smallest price that keeps within it. Deterministic
    in its arguments.

    ``only`` (name -> label) prices a given choice instead: the plan that sends each
    gradient as ``only`` says, under these figures, regimes and budgets, or None where
    one of them rules that choice out (``AutoPlanner`` weighs keeping its plan
    against a new one).

    With ``pace`` (from the steps that ran), the low-rank error also costs steps: of
    the choices at a few prices of the low-rank budget, from the least that keeps
    within it to one that sends nothing low-rank, the plan is the one with the least
    ``Pace.seconds``. The steps a whole budget adds (``Pace.low_rank_steps`` of a
    step) are priced at 0 and at 1/4 to 4 times their seconds; at each, the others'
    budget at the least price that keeps them within it.

    ``capped`` (name -> bound): gradients outside the error budget that take only
    quantizers of at most that bound, or a measured candidate that loses at most what
    PowerSGD at the low-rank budget's rank would lose on them: the dense embedding
    tables (``plan_tables``). Their shares of the low-rank budget are their own: the
    other gradients together lose at most their own shares, whatever the tables go
    as.

    ``budget_of``: the gradients whose loss under PowerSGD at the budget's rank is the
    whole low-rank budget (default ``gradients``), a superset of them. ``plan_tables``
    gives every gradient, its tables whichever way they go: a share of the budget, and
    the steps it costs, are then in the same units for every choice of the tables.
    (Measured against the budget of the gradients planned, a dense table whose own
    low-rank loss is large made the budget larger and every other gradient's share
    smaller: its steps looked cheaper by that, and dense won for it.)

    ``held`` (name -> the label it went as): gradients that may not go lossier than the
    plan that ran (after a learning-rate decay, ``AutoPlanner.adapt``; they are in
    ``critical`` too): a quantizer of at most the bound of the one it went as (of the
    critical bound where it went low rank or top-k), low rank only where it went low
    rank, at that rank or more, and top-k only where it went top-k. ACCORDION
    compresses less after a decay; a critical regime alone bounds what each gradient
    loses, not whether it loses more than it did.

    ``forced`` (with ``only``, which then names every gradient): the choice as given,
    whatever the regimes and budgets say (``AutoPlanner.pin``: a plan set by hand), each
    entry's reason "pinned"; a gradient whose label does not take its shape or dtype
    goes as float32, its reason saying so, and a measured candidate (low rank, top-k)
    needs only its CPU timings in ``figures`` (its error, where not measured, is NaN).
    None where ``figures`` lack those timings.
    """
    capped = capped or {}
    held = {name: BY_LABEL.get(label) for name, label in (held or {}).items()}
    w = figures.num_workers
    link = figures.link()
    total = sum(int(np.prod(shape, dtype=np.int64)) for name, shape, _ in gradients
                if name not in capped) or 1
    lr_budget = shared_budget = 0.0
    if low_rank is not None:
        lr_budget = low_rank.budget({name: shape for name, shape, _ in
                                     (gradients if budget_of is None else budget_of)})
        # A dense table (``capped``) may lose low-rank what PowerSGD at the budget's
        # rank would lose on it and no more; the others, their own shares together. So
        # a table's way (rows or dense) leaves theirs as it is. (Tables that could
        # borrow from the others' shares won less: the multiplier of the budget kept a
        # table's cheap excess and moved a matrix a rank up to pay for it, where the
        # table at its own share and the matrix as it was ran faster.)
        shared_budget = low_rank.budget({name: shape for name, shape, _ in gradients
                                         if name not in capped})
    # The others' whole budget, as a share of ``lr_budget`` (``lr`` is in its units).
    shared_limit = shared_budget / lr_budget if lr_budget > 0 else 0.0
    if forced and only is None:
        raise ValueError("make_plan(forced=True) needs `only`")
    options, unfit = [], {}
    for name, shape, dtype in gradients:
        n = int(np.prod(shape, dtype=np.int64))
        tf_shape, tf_dtype = tf.TensorShape(shape), tf.as_dtype(dtype)
        wanted = None if only is None else only.get(name)
        if forced:
            described = BY_LABEL[wanted].described if wanted in BY_LABEL else None
            if described is not None and not described.supports(tf_shape, tf_dtype):
                unfit[name], wanted = wanted, "fp32"
        mine = []
        for order, candidate in enumerate(ALL):
            if only is not None and candidate.label != wanted:
                continue
            compressor = candidate.described
            if compressor is not None and not compressor.supports(tf_shape, tf_dtype):
                continue
            if candidate.error_key is None:
                bound, lr = candidate.variance_bound(n), 0.0
                if not forced and name in critical and bound > critical_bound:
                    continue
                went = held.get(name)
                if not forced and went is not None and went.error_key is None \
                        and bound > went.variance_bound(n):
                    continue
                if not forced and name in capped and bound > capped[name]:
                    continue
            elif forced:
                # As pinned: the measured error where there is one, counted in the
                # low-rank budget as the plan uses it (beyond it, maybe).
                if candidate.label not in figures.encode_us:
                    continue
                sq, rel = (low_rank.errors[name] if low_rank is not None
                           and name in low_rank.errors else (0.0, {}))
                bound = rel.get(candidate.error_key, float("nan"))
                lr = sq * bound / lr_budget if lr_budget > 0 and math.isfinite(bound) else 0.0
            else:
                # Measured gradients only, at the critical rank or more in a critical
                # regime and within its error there (top-k not at all: ACCORDION sends
                # less compressed there), and a loss that fits.
                if low_rank is None or name not in low_rank.errors \
                        or candidate.label not in figures.encode_us \
                        or (name in critical and (candidate.rank is None
                                                  or low_rank.critical_rank is None
                                                  or candidate.rank < low_rank.critical_rank)) \
                        or (name in held and not _no_lossier(held[name], candidate)):
                    continue
                sq, rel = low_rank.errors[name]
                bound = rel.get(candidate.error_key)
                if bound is None or sq * bound > lr_budget \
                        or (name in critical and not bound <= low_rank.critical_error) \
                        or (name in capped and not bound <= rel[low_rank.rank]):
                    continue
                lr = sq * bound / lr_budget if lr_budget > 0 else 0.0
            path = path_of(candidate, w)
            sent = sent_bytes(candidate, path, shape, dtype, w)
            cpu = cpu_seconds(figures, candidate, path, n)
            mine.append(dict(order=order, candidate=candidate, path=path, sent=sent, cpu=cpu,
                             wire=sent * link.beta, bound=bound,
                             mass=(0.0 if candidate.error_key is not None or name in capped
                                   else bound * n / total),
                             lr=lr, charged=0.0 if name in capped else lr,
                             pen=0.0, dense=n * tf_dtype.size))
        options.append((name, tuple(shape), dtype, mine))
    if only is not None and (
            any(not mine for _, _, _, mine in options)
            or not forced and (
                sum(mine[0]["mass"] for _, _, _, mine in options) > error_budget + 1e-12
                or sum(mine[0]["charged"] for _, _, _, mine in options)
                > shared_limit + 1e-9)):
        return None

    def solve(price, steps=0.0):
        """The plan's choice when each unit of the low-rank budget outside the dense
        tables costs ``price`` s, and each unit of it all ``steps`` s more (the steps
        its error adds, under the pace)."""
        priced = [[dict(o, pen=price * o["charged"] + steps * o["lr"]) for o in mine]
                  for _, _, _, mine in options]

        def pick(lam):
            return [min(mine, key=lambda o: (_cost(o) + lam * o["mass"], o["mass"], o["order"]))
                    for mine in priced]

        def mass(choice):
            return sum(o["mass"] for o in choice)

        lam = 0.0
        choice = pick(0.0)
        if forced:  # one option a gradient: nothing to weigh
            return lam, choice, choice, choice
        if mass(choice) > error_budget:
            lam, choice = _lagrangian(pick, mass, error_budget)
            choice = _fill(choice, priced, error_budget - mass(choice))
            if error_budget > 0:
                exact = _knapsack(priced, error_budget)
                if exact is not None and sum(_cost(o) for o in exact) < \
                        sum(_cost(o) for o in choice):
                    choice = exact
        budgeted = choice
        choice = _consolidate(choice, priced, max(error_budget, mass(choice)), link, w,
                              shared_limit)
        return lam, budgeted, choice, pick(0.0)

    def used(solved):
        """The share of the low-rank budget the choice loses (the dense tables' too)."""
        return sum(o["lr"] for o in solved[2])

    def over(solved):
        """Whether the choice loses more than the others' budget (the dense tables keep
        to their own shares)."""
        return sum(o["charged"] for o in solved[2]) > shared_limit + 1e-9

    # The bisection's first price of a whole budget: the slowest step the options make.
    first_price = sum(max(o["cpu"] + o["wire"] for o in mine)
                      for _, _, _, mine in options) or 1.0

    def within(steps=0.0):
        """The choice at the least price of the others' budget that keeps them within
        it, with each unit of the whole budget costing ``steps`` s more. The price is
        bisected for each ``steps``: the steps' price moves the choice (a table summed
        dense goes quantized, and the groups it made with the others go with it), so a
        price that held the others at one ``steps`` need not at another. (Found once,
        with no steps priced, it let a matrix go to rank 1, beyond its own rank 2, once
        priced steps moved a dense table to 8-bit; and it kept matrices at rank 4 or
        8-bit where rank 2 was within their share and faster.)"""
        solved = solve(0.0, steps)
        if forced or not over(solved):
            return solved
        # From the step's seconds up, until the choice fits (at a price high enough,
        # only options that lose nothing remain), then down to the least that does.
        hi = first_price
        for _ in range(60):
            if not over(solve(hi, steps)):
                break
            hi *= 4.0
        lo = 0.0
        for _ in range(32):
            mid = (lo + hi) / 2.0
            if not over(solve(mid, steps)):
                hi = mid
            else:
                lo = mid
        return solve(hi, steps)

    solved = within()
    if pace is not None and pace.low_rank_steps > 0 and only is None and used(solved) > 0:
        def paced(solved):
            return pace.seconds(_step_seconds(solved[2], link, w), used(solved))

        # A whole budget's steps, in the predicted seconds the options are priced in.
        unit = pace.low_rank_steps * paced(solved) / pace.scale
        tries = [solved] + [within(unit * f) for f in (0.25, 0.5, 1.0, 2.0, 4.0)]
        tries.append(within(unit * 1e6))  # nothing low-rank that loses anything
        solved = min(tries, key=lambda t: (paced(t), used(t)))
    lam, budgeted, choice, fastest = solved
    entries = []
    for (name, shape, dtype, _), o, before, quick in zip(options, choice, budgeted, fastest):
        reason = ""
        if forced:
            reason = (f"pinned as {unfit[name]}, which does not take this gradient"
                      if name in unfit else "pinned")
        elif o["candidate"].spec is None:
            if before["candidate"].spec is not None:
                reason = "its group saves less than its own collectives cost"
            elif quick["candidate"].spec is None:
                reason = "float32 is the fastest on this link"
            else:
                reason = "the error budget"
        entries.append(Entry(name=name, shape=shape, dtype=dtype, label=o["candidate"].label,
                             path=o["path"], dense_bytes=o["dense"], sent_bytes=o["sent"],
                             cpu_s=o["cpu"], wire_s=o["wire"], error=o["bound"],
                             reason=reason, critical=name in critical))
    return Plan(tuple(entries), error_budget, w, link, figures, lam,
                low_rank_budget=lr_budget,
                low_rank_error=sum(o["lr"] for o in choice) * lr_budget, pace=pace)


# -- embedding tables ---------------------------------------------------------------

# The passes over a table that its gradient costs when it is summed into a dense one,
# beyond the reduction the plan prices: the rows added into zeros of the table's shape,
# and the optimizer's update of every row where it would have scattered the touched
# ones. Each is priced as a bf16 cast of the table (a read and a narrower write), the
# measured line closest to one pass over memory.
DENSIFY_PASSES = 2
# Tables whose every choice of rows or dense is priced; beyond, all rows or all dense.
TABLE_CHOICES = 3


def row_candidate(entries: Sequence[Entry], error_budget: float,
                  num_workers: int, critical: bool = False) -> Optional[Candidate]:
    """What embedding rows travel as beside a plan of ``entries``: the quantizing
    candidate that carries most of the planned elements (the plan's view of the link);
    where the plan quantizes nothing but sends some gradients as measured candidates,
    low-rank or top-k (rows change from step to step: no residual or query of their
    own), or where it plans nothing beside the tables, the quantizer that sends the
    fewest bytes an element within ``error_budget``, or within ``CRITICAL_BOUND`` while
    some gradient (or, with ``critical``, a table planned alone) is critical (ties: the
    least error); None (the stock gather) when the plan sends everything as float32,
    no quantizer fits, or there is no other worker to send to."""
    if num_workers < 2:
        return None
    elements = {}
    for e in entries:
        if e.label != "fp32" and e.candidate.error_key is None:
            elements[e.label] = elements.get(e.label, 0) + int(np.prod(e.shape))
    if elements:
        # Ties go to the candidate with less error (max keeps the first).
        return max(CANDIDATES, key=lambda c: elements.get(c.label, 0))
    if entries and not any(e.candidate.error_key is not None for e in entries):
        return None
    within = row_quantizers(error_budget, critical or any(e.critical for e in entries))
    if not within:
        return None
    block = (embeddings.BLOCK_ENTRIES,)
    return min(within, key=lambda c: sent_bytes(c, "allgather", block, "float32",
                                                max(num_workers, 2)))


def row_quantizers(error_budget: float, critical: bool = False) -> List[Candidate]:
    """The quantizers embedding rows may go as within ``error_budget`` (within
    ``CRITICAL_BOUND`` with ``critical``, as critical gradients take), from the least
    error to the most."""
    budget = min(error_budget, CRITICAL_BOUND) if critical else error_budget
    return [c for c in CANDIDATES[1:] if c.variance_bound(embeddings.BLOCK_ENTRIES) <= budget]


@functools.lru_cache(maxsize=256)
def _block_words(label: str, rows: int, size: int, dtype: str, num_workers: int) -> int:
    return num_payload_words(embeddings.payload_like(
        BY_LABEL[label].compressor, [rows, size], tf.as_dtype(dtype), num_workers))


def rows_table(table: Table, candidate: Optional[Candidate], figures: Figures,
               head: bool = True) -> Table:
    """``table`` sent as its rows in ``candidate`` (None: float32 on the stock gather),
    priced: the all-gather of the blocks ``embeddings.reduce_rows`` sends (each
    worker's padded to the most blocks) after its row count (and, with ``head``, the
    guard's control words, which the tables of a step share), the encoding of its
    blocks and the decoding of every worker's, each priced as one call on all their
    elements: each is one loop (``tf.map_fn``) in the traced step, whose iterations do
    not pay the launch that the figures' per-call cost holds (16 blocks of 64 x 64
    rows in rotated 8 bits encoded in 0.79 ms a call of the loop in a ``tf.function``,
    one call on their 65536 elements in 0.50 ms, where this machine's figures priced
    16 calls of 4096 at 1.1 ms). A table whose rows are not counted yet is priced at
    nothing."""
    n, link = figures.num_workers, figures.link()
    label = "fp32" if candidate is None else candidate.label
    out = dataclasses.replace(table, dense=False, label=label, sent_bytes=0, cpu_s=0.0,
                              wire_s=0.0)
    if not table.rows or n < 2:
        return out
    size = int(np.prod(table.shape[1:], dtype=np.int64))
    if candidate is None or candidate.spec is None:
        # Values and int32 indices of every occurrence, as the stock gather sends them.
        sent = (n - 1) * table.tokens * (size * tf.as_dtype(table.dtype).size + 4)
        return dataclasses.replace(out, sent_bytes=sent, wire_s=sent * link.beta)
    r = embeddings.block_rows_of(table.shape)
    blocks = -(-table.rows // r)
    width = _block_words(label, r, size, table.dtype, n)
    sent = (n - 1) * 4 * (blocks * (width + r) + 1 + (guard.CONTROL_WORDS if head else 0))
    elements = blocks * r * size
    cpu = figures.encode(label)(elements) + figures.decode(label)(n * elements)
    return dataclasses.replace(out, sent_bytes=sent, cpu_s=cpu, wire_s=sent * link.beta)


def plan_tables(gradients: Sequence[Tuple[str, Sequence[int], str]],
                tables: Dict[int, Tuple[int, int]], figures: Figures, error_budget: float,
                dense=None, rows_label: Optional[str] = None, **kwargs) -> Optional[Plan]:
    """The plan for ``gradients`` (``make_plan``'s, in their order) among which the
    embedding tables are at the indices ``tables`` maps to their counted rows (the most
    distinct rows and the most rows with repeats a worker sent; 0: not counted yet).

    Each table goes either as its rows (``embeddings.ROWS``, priced by ``rows_table``)
    in the quantizer ``row_candidate`` picks beside the plan that sends every table as
    rows, or summed into a dense gradient that the plan prices as any other
    (``DENSIFY_PASSES`` added), with a quantizer of at most that one's bound, or low
    rank or top-k within its own share of the low-rank budget (what PowerSGD at the
    budget's rank loses on it). Neither way adds to the quantizers' error budget or
    to the other gradients' low-rank budget, which stay theirs, so the choice is one
    of time (where a dense table's share was the others' too, a table sent whole lent
    it to them, and dense won for the budget it freed): ``dense``
    (a set of places among the tables) fixes which go dense; None takes the least
    ``Plan.paced_seconds`` among every choice for the counted tables (all rows or all
    dense beyond ``TABLE_CHOICES`` of them; ties keep rows), uncounted ones as rows.
    Where nothing but the tables is planned (a bag of embeddings under a head too
    small to plan), the plan gives the rows no view of the link: they go as
    ``row_candidate``'s quantizer until their rows are counted, then as whichever of
    the quantizers within the budget (``row_quantizers``) and float32 on the stock
    gather the plan prices fastest.
    ``rows_label``: the candidate the rows go as instead (a running plan priced anew
    keeps what its traced step sends, a pinned one what the pin says). ``kwargs``:
    ``make_plan``'s (with ``forced``, no budget or regime rules out ``rows_label``).
    None where ``make_plan`` returns None (``only``), or where the tables are planned
    alone and the budget or a critical table rules out ``rows_label``."""
    order = sorted(tables)
    places = {k: p for p, k in enumerate(order)}
    counted = [p for p, k in enumerate(order) if tables[k][0] > 0]
    if dense is not None:
        choices = [frozenset(dense)]
    elif len(counted) <= TABLE_CHOICES:
        choices = [frozenset(c for j, c in enumerate(counted) if mask >> j & 1)
                   for mask in range(1 << len(counted))]
    else:
        choices = [frozenset(), frozenset(counted)]

    def planned(choice, capped=None):
        return make_plan([g for k, g in enumerate(gradients)
                          if k not in places or places[k] in choice], figures, error_budget,
                         capped=capped, budget_of=gradients, **kwargs)

    plans = {}
    critical = frozenset(kwargs.get("critical") or ())
    critical_table = any(gradients[k][0] in critical for k in order)
    if rows_label is not None:
        candidates = [BY_LABEL[rows_label]]
    else:
        plans[frozenset(), None] = rows = planned(frozenset())
        if rows is None:
            return None
        alone = not rows.entries
        candidates = [row_candidate(rows.entries, error_budget, figures.num_workers,
                                    critical=alone and critical_table)]
        if alone and counted and candidates[0] is not None:
            # Priced, every quantizer within the budget (from the least error: ties
            # among them keep it) and float32: the fewest bytes need not be the
            # fastest (rotated 8 bits send as many as plain 8 bits and cost a
            # transform each way).
            candidates = row_quantizers(error_budget, critical_table) + [None]
    # fp32: the stock gather.
    candidates = [None if c is None or c.spec is None else c for c in candidates]
    best = None
    for candidate, choice in itertools.product(candidates, choices):
        # The rows' quantizer caps the dense tables' error: without one, the plan is
        # the same whatever the rows go as.
        key = (choice, candidate.label if choice and candidate is not None else None)
        if key not in plans:
            plans[key] = planned(choice, {
                gradients[order[p]][0]: 0.0 if candidate is None else
                candidate.variance_bound(int(np.prod(gradients[order[p]][1])))
                for p in choice})
        plan = plans[key]
        if plan is None:
            continue
        lines = []
        for p, k in enumerate(order):
            name, shape, dtype = gradients[k]
            table = Table(place=p, name=name, shape=tuple(shape), dtype=dtype,
                          dense=p in choice, rows=tables[k][0], tokens=tables[k][1],
                          label="fp32" if candidate is None else candidate.label)
            if table.dense:
                passes = DENSIFY_PASSES * figures.encode("bf16")(int(np.prod(shape)))
                lines.append(dataclasses.replace(table, cpu_s=passes))
            else:
                first = not any(not t.dense for t in lines)
                lines.append(rows_table(table, candidate, figures, head=first))
        plan = dataclasses.replace(plan, tables=tuple(lines))
        if best is None or plan.paced_seconds() < best.paced_seconds():
            best = plan
    if rows_label is not None and best is not None and candidates[0] is not None \
            and not kwargs.get("forced"):
        # Tables planned alone take their rows' quantizer within the budget (and the
        # critical bound) themselves: one the current regimes or budget no longer allow
        # (a restored plan's, or a running one's once a table turned critical) rules
        # the plan out, as a gradient's label beyond its bound does.
        names = {gradients[k][0] for k in order}
        if all(e.name in names for e in best.entries) and \
                candidates[0] not in row_quantizers(error_budget, critical_table):
            return None
    return best
