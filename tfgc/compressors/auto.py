"""``compressor="auto"``: a compression plan per gradient, from the measured link and CPU.

``Auto`` holds the plan's hyperparameters only; the plan itself is made by the
cross-device ops at the first gradient reduction (``tfgc.distribute.planner``): every
worker times an all-reduce probe of a few sizes and each candidate's encoding and
decoding on its own CPU, the workers agree on the slowest figures, and each gradient
takes the candidate with the smallest predicted time (CPU plus wire) that the error
budget allows. The candidates, from the least error to the most, as the plan's table
names them:

* ``fp32``: the gradient as it is, on the all-reduce (error 0);
* ``bf16``: 16 bits on the all-reduce (relative error per element at most 2**-8);
* ``rqsgd8``, ``qsgd:levels=127,bucket_size=512,norm=max,rotate=true``: 8 bits after a
  randomized Hadamard rotation (bound 0.00025);
* ``qsgd8``, ``qsgd:levels=127,bucket_size=512``: 8 bits (QSGD's variance bound 0.032);
* ``rqsgd4``, ``qsgd:levels=7,bucket_size=128,norm=max,rotate=true``: 4 bits, rotated
  (bound 0.068),

the QSGD ones over the reduce-scatter from 3 workers on (``paths.auto``); and, once
training has measured them, PowerSGD at ranks 1, 2, 4 and 8 (``psgd1`` ... ``psgd8``,
error feedback, the low-rank path) and top-k at 1 % with error feedback (``topk1``,
the all-gather), under a budget of their own (below). The error
of a candidate on a gradient is the bound on E||C(g) - g||^2 / ||g||^2 that holds for
every gradient (``QSGD.variance_bound``: Lemma 3.1 of the QSGD paper, min(d/s^2,
sqrt(d)/s) for buckets of d elements and s levels; for the rotated ones a bound through
the rotation's sub-Gaussian coordinates; a cast: its unit roundoff squared), and the
budget bounds the mean of these
over the compressed gradients' elements.

Low rank: PowerSGD's error has no such bound; it depends on the gradient's spectrum. So,
as L-GreCo does (Markov et al., MLSys 2024), ``tfgc.keras.AutoPlanCallback`` measures
it at the end of each interval of training, for every matrix at every rank, and the
plan keeps the low-rank gradients' total error within what PowerSGD at rank
``low_rank`` on every matrix would lose: where one layer is nearly low-rank and another
is not, the first may take rank 1 and the second 8, or a quantizer. Top-k's error,
what a gradient's largest 1 % of entries leave, is measured with them and counts in
the same budget. Without the callback, or with ``low_rank=0``, no gradient goes
low-rank or top-k.

Embedding tables (``tf.IndexedSlices`` gradients): each goes as the rows a step touched,
quantized, or summed into a dense gradient that the plan sends like the others,
whichever it prices faster (``planner.plan_tables``) from the rows a step counted; the
first plan, before any step, sends them as rows, so a table goes dense only at a later
plan (with ``tfgc.keras.AutoPlanCallback``, or ``replan``).
"""

from typing import Optional

from tfgc.compressors.base import Compressor, check_int, check_number, check_positive_float


# ``low_rank`` and ``critical_rank``: 0 (none) or one of the planner's ranks.
_RANKS = (0, 1, 2, 4, 8)


def _check_rank(name: str, value):
    """Refuses a rank that is not an integer (``check_int``: not a bool, not 4.0) of
    ``_RANKS``."""
    check_int(name, value, 0, _RANKS[-1])
    if value not in _RANKS:
        raise ValueError(f"`{name}` must be 0 (none), 1, 2, 4 or 8, got {value!r}")


class Auto(Compressor):
    """Plans each gradient's compression (see the module docstring).

    Args:
      error: the error budget: the largest mean, over the planned gradients'
        elements, of the candidates' relative variance bounds. 0 sends everything
        as float32; the default 0.05 allows rotated 4 bits (0.068) on about 73 % of
        the elements and rotated 8 bits on the rest; 0.068 allows 4 bits everywhere.
      link_gbps: the link rate in Gbit/s to plan for instead of measuring it (0: measure
        with the probe). With it, ``latency_ms`` is the link's latency.
      latency_ms: with ``link_gbps``, the latency of one hop (a message that waits for
        the previous one: a ring all-reduce on N workers takes 2(N-1) of them). Without
        ``link_gbps`` the probe measures it, and another value than the default is an
        error.
      low_rank: the PowerSGD rank (1, 2, 4 or 8) whose measured error on every matrix,
        summed, is the budget of the low-rank candidates; 0: no gradient goes
        low-rank. Default 2, PowerSGD's rank that matched SGD's accuracy on CIFAR-10
        in its paper.
      low_rank_steps: the extra steps, as a share, that training needs to reach the
        same accuracy with every measured matrix low-rank at ``low_rank`` (a whole
        low-rank budget; a plan using a share u of it, u times that). Once steps have been
        timed (``tfgc.keras.AutoPlanCallback``), a plan sends gradients low-rank only
        where the time it saves a step pays for the steps it adds. Default 0.3: on this
        project's time-to-accuracy runs (4 workers, momentum SGD), fixed PowerSGD at
        rank 2 needed 1.36-1.40x the steps of float32 or bf16 to the target on the
        CNN, and 1.55x on the wide MLP, on a schedule twice as long (which is itself
        slower to a target); ``auto``'s own rank-4 plans on the dense schedule,
        1.0-1.13x; on a GAN with Adam (``benchmarks/gan_quality.py``, to the same
        sample quality), 1.15-1.23x. 0: the time per step alone decides.
      critical_rank: the least PowerSGD rank a gradient may go as while it is in a
        critical regime (``tfgc.keras.AutoPlanCallback``: early training, or after a
        learning-rate decay): 1, 2, 4 or 8, at least ``low_rank``; 0: none, a critical
        gradient goes as float32 or bf16 only. Default (None): twice ``low_rank``, at
        most 8, as ACCORDION's PowerSGD runs raise the rank there rather than stop
        compressing. A rank given is a setting of its own, even where the default
        would take the same (workers compare their settings as written).
      critical_error: the most relative error, as measured on worker 0's last local
        gradient, that a gradient in a critical regime may lose low-rank (at a rank of
        ``critical_rank`` or more); above it at every such rank, it goes as float32 or
        bf16. Default 0.05, the mean error the quantizers may lose by default
        (``error``). Early in training a gradient can be far from low-rank: at the
        fourth step of one process taking 32 rows a step (docs/results.md), rank 8
        left 0.31-0.51 of most MobileNetV2 kernels' gradients out, and 0.001-0.03 of
        the wide MLP's and the CNN's; by step 117 MobileNetV2's median was 0.02-0.04.
        1 or more: no limit. A plan pinned by hand is exempt. Another value than the
        default needs low-rank candidates (``low_rank`` above 0).
    """

    name = "auto"
    # Gradients are planned one by one by the cross-device ops (``planner``); this
    # object is never asked to compress.
    plans_per_tensor = True

    def __init__(self, error: float = 0.05, link_gbps: float = 0.0, latency_ms: float = 0.1,
                 low_rank: int = 2, low_rank_steps: float = 0.3,
                 critical_rank: Optional[int] = None, critical_error: float = 0.05):
        self.error = float(check_number("error", error, 0))
        self.link_gbps = float(check_number("link_gbps", link_gbps, 0, also=" (0: measure)"))
        self.latency_ms = check_positive_float("latency_ms", latency_ms)
        if self.latency_ms != 0.1 and not self.link_gbps:
            # Not the default: a latency meant for a link the probe measures instead.
            raise ValueError(f"`latency_ms` ({latency_ms!r}) is the latency of a given link: "
                             "give `link_gbps` too, or neither (the probe measures both)")
        _check_rank("low_rank", low_rank)
        # Not ``low_rank``: that attribute (None here) says whether a compressor itself
        # sends low-rank factors, and the paths and embeddings read it so.
        self.budget_rank = int(low_rank)
        self.low_rank_steps = float(check_number("low_rank_steps", low_rank_steps, 0))
        if self.low_rank_steps == float("inf"):
            raise ValueError("`low_rank_steps` must be finite, got inf")
        if critical_rank is not None:
            _check_rank("critical_rank", critical_rank)
            if critical_rank and not self.budget_rank:
                raise ValueError("`critical_rank` needs low-rank candidates: with "
                                 "`low_rank=0` no gradient goes low-rank at all")
            if 0 < critical_rank < self.budget_rank:
                raise ValueError(f"`critical_rank` ({critical_rank}) is below `low_rank` "
                                 f"({self.budget_rank}): a critical gradient would lose "
                                 "more than the others; give a rank of at least "
                                 f"{self.budget_rank}, or 0 for none")
            critical_rank = int(critical_rank)
        self.critical_rank = critical_rank
        self.critical_error = float(check_number("critical_error", critical_error, 0))
        if self.critical_error != 0.05 and not self.budget_rank:
            # Not the default: a limit on low rank where nothing goes low-rank.
            raise ValueError(f"`critical_error` ({critical_error!r}) limits low rank while "
                             "critical: with `low_rank=0` no gradient goes low-rank at all")

    def get_config(self):
        config = super().get_config()
        config["low_rank"] = self.budget_rank  # kept as ``budget_rank`` (see __init__)
        if self.critical_rank is None:
            # The default, left out: a spec string has no None.
            del config["critical_rank"]
        return config

    def compress(self, x, state, ctx):
        raise NotImplementedError(
            "compressor 'auto' is a plan, not an encoding: the cross-device ops compress each "
            "gradient with the candidate its plan names")

    def decompress(self, payload, shape, dtype, ctx):
        raise NotImplementedError("compressor 'auto' has no payload of its own")
