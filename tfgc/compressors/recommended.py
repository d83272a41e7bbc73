"""Recommended settings: how to train with each compressor so that it keeps accuracy.

A compressor's defaults say what it sends; whether a run reaches dense accuracy also
depends on where momentum is applied, on the learning rate and on its schedule. This
module holds, for every registry name, the setting tfgc recommends, as data:

    rec = tfgc.compressors.recommended("dgc")
    rec.spec(steps_per_epoch=234)     # 'dgc:ratio=0.001,warmup_steps=234'
    rec.optimizer                     # 'sgd': dgc applies momentum 0.9 on the workers
    rec.learning_rate(0.05)           # the dense run's rate times rec.lr_scale

``tfgc-train --recommended`` trains with it (the compressor, the optimizer, the rate and
its schedule) and the README's compressor table lists it. Every setting uses the same
schedule as the dense reference, a linear warm-up over ``warmup_epochs`` then a cosine
decay to zero at the end of the run (Goyal et al. 2017 §2.2 for the warm-up; Loshchilov
& Hutter 2017 for the cosine), so that a comparison with dense changes one thing.

``optimizer`` names what the Keras optimizer does, as ``tfgc.apps.train.make_optimizer``
does: ``"momentum"`` is SGD with heavy-ball momentum 0.9 in the optimizer, ``"sgd"`` is
plain SGD, used where the compressor applies the momentum itself on the workers
(momentum correction, Lin et al. 2018 §3.2) or where the method's paper trains without
it. ``lr_scale`` multiplies the rate tuned for the dense run.

This module needs the standard library only (benchmark drivers load it without
TensorFlow). Where a setting comes from is in its ``source``; ``benchmarks/results/`` holds the runs
behind the figures quoted there.
"""

import dataclasses
import difflib
from typing import Optional

OPTIMIZERS = ("momentum", "sgd")
SCHEDULES = ("cosine", "constant")


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """One compressor's recommended training setting.

    Attributes:
      name: the registry name it is for.
      compressor: the compressor string; ``{steps_per_epoch}`` in it stands for the
        run's steps per epoch (``spec`` fills it in).
      optimizer: ``"momentum"`` (SGD, momentum 0.9) or ``"sgd"`` (plain SGD).
      lr_scale: multiplies the dense run's learning rate.
      warmup_epochs: epochs of linear learning-rate warm-up.
      schedule: ``"cosine"`` (decay to zero over the run after warm-up) or
        ``"constant"``.
      epochs_scale: the run's length as a multiple of the dense run's epochs
        (``epochs`` computes it): 1 where the compressor keeps dense accuracy at
        dense's schedule, more where it needs more (cheaper) steps to reach it.
      source: why, with the paper or the measurement behind it.
    """

    name: str
    compressor: str
    optimizer: str
    lr_scale: float = 1.0
    warmup_epochs: float = 1.0
    schedule: str = "cosine"
    epochs_scale: float = 1.0
    source: str = ""

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"`optimizer` must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"`schedule` must be one of {SCHEDULES}, got {self.schedule!r}")
        if not self.lr_scale > 0:
            raise ValueError(f"`lr_scale` must be > 0, got {self.lr_scale!r}")
        if not self.warmup_epochs >= 0:
            raise ValueError(f"`warmup_epochs` must be >= 0, got {self.warmup_epochs!r}")
        if isinstance(self.epochs_scale, bool) or not self.epochs_scale >= 1:
            raise ValueError(f"`epochs_scale` must be >= 1, got {self.epochs_scale!r}")

    @property
    def needs_steps_per_epoch(self) -> bool:
        return needs_steps_per_epoch(self.compressor)

    def spec(self, steps_per_epoch: Optional[int] = None) -> str:
        """The compressor string, with the run's steps per epoch filled in."""
        if not self.needs_steps_per_epoch:
            return self.compressor
        if (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                or steps_per_epoch < 1):
            raise ValueError(f"{self.name!r}'s recommended setting {self.compressor!r} "
                             "needs the run's `steps_per_epoch` (an integer >= 1), got "
                             f"{steps_per_epoch!r}")
        return self.compressor.replace("{steps_per_epoch}", str(steps_per_epoch))

    def learning_rate(self, dense_learning_rate: float) -> float:
        """The rate to train at, from the one the dense run uses."""
        if isinstance(dense_learning_rate, bool) or not dense_learning_rate > 0:
            raise ValueError(f"`dense_learning_rate` must be > 0, got {dense_learning_rate!r}")
        return float(dense_learning_rate) * self.lr_scale

    def epochs(self, dense_epochs: int) -> int:
        """Epochs to train, from the dense run's (``epochs_scale`` times, rounded)."""
        if (isinstance(dense_epochs, bool) or not isinstance(dense_epochs, int)
                or dense_epochs < 1):
            raise ValueError(f"`dense_epochs` must be an integer >= 1, got {dense_epochs!r}")
        return int(round(dense_epochs * self.epochs_scale))  # >= dense_epochs: scale >= 1

    def describe(self, steps_per_epoch: Optional[int] = None,
                 compressor: Optional[str] = None) -> str:
        """One line: compressor, optimizer, rate and schedule. The compressor string is
        ``compressor`` when given (the one a run trained with), else this setting's,
        with the run's ``steps_per_epoch`` filled in when given."""
        if compressor is not None:
            spec = compressor
        elif steps_per_epoch is not None:
            spec = self.spec(steps_per_epoch)
        else:
            spec = self.compressor
        opt = "momentum SGD (0.9)" if self.optimizer == "momentum" else "plain SGD"
        rate = "the dense rate" if self.lr_scale == 1 else f"{self.lr_scale:g} x the dense rate"
        sched = (f"{self.warmup_epochs:g}-epoch warm-up, then {self.schedule}"
                 if self.warmup_epochs else self.schedule)
        length = ("" if self.epochs_scale == 1
                  else f", {self.epochs_scale:g} x the dense run's epochs")
        return f"{spec}, {opt}, {rate}, {sched}{length}"


# Settings that keep dense accuracy at dense's schedule: the casts and 8-bit QSGD. The
# others train twice as many (cheaper) steps: on the wide MLP, error feedback and
# PowerSGD needed 1.8-1.9 x stock's steps to reach its final accuracy less 0.5 point
# (benchmarks/results/time_to_accuracy.md), and on the MLP, top-k 0.1 % with error
# feedback at 12 epochs ends level with dense at 4 (ablation_long_mlp.md).
_DENSE_SCHEDULE = ("none", "fp16", "bf16", "qsgd", "auto")


def _rec(name, compressor, optimizer, source, **kw):
    kw.setdefault("epochs_scale", 1.0 if name in _DENSE_SCHEDULE else 2.0)
    return Recommendation(name=name, compressor=compressor, optimizer=optimizer,
                          source=source, **kw)


_HEAVY_BALL = ("heavy-ball momentum in the optimizer, as the dense reference: the "
               "compressor keeps no residual for the momentum to interact with")

_TABLE = [
    _rec("none", "none", "momentum",
         "the dense reference: momentum SGD (0.9), the baseline of every paper here"),
    _rec("auto", "auto", "momentum",
         "the dense optimizer and schedule: its quantizers keep no residual, as bf16 and "
         "QSGD do, and its low-rank gradients (with AutoPlanCallback) stay within rank "
         "2's measured error (while critical, twice that rank where its measured "
         "error is at most 0.05, else 16 bits); on the small CNN it "
         "reached the target 10 s sooner on the dense schedule than on twice its "
         "epochs (benchmarks/results/time_to_accuracy_auto_cnn.md, "
         "time_to_accuracy_auto_cnn_4epochs.md)"),
    _rec("fp16", "fp16", "momentum", _HEAVY_BALL),
    _rec("bf16", "bf16", "momentum", _HEAVY_BALL),
    _rec("topk", "topk:ratio=0.01", "momentum",
         "top-k without memory loses accuracy at any optimizer (4-5 points in "
         "benchmarks/results/convergence.md); prefer ef+topk"),
    _rec("randomk", "ef+randomk:ratio=0.01", "sgd",
         "random-k learns only with memory (Stich et al. 2018, memory SGD: plain SGD)"),
    _rec("ef", "ef+topk:ratio=0.001,momentum=0.9", "sgd",
         "top-k with error feedback at DGC's 0.1 % density, with the momentum applied on "
         "the workers before compression (momentum correction, Lin et al. 2018 §3.2): on "
         "the MLP, 4 workers, 4 epochs, it ended 2.2 points above heavy-ball momentum in "
         "the optimizer and 3.4 above plain SGD "
         "(benchmarks/results/ablation_ef_optimizer_mlp.md)"),
    _rec("onebit", "onebit:momentum=0.9", "sgd",
         "1-bit SGD (Seide et al. 2014) with momentum applied on the workers before "
         "quantization (momentum correction), plain SGD in the optimizer"),
    _rec("signsgd", "signsgd", "sgd",
         "signSGD (Bernstein et al. 2018): every coordinate moves by the full rate, so "
         "the rate is far below SGD's (0.002 against 0.05 in our runs)",
         lr_scale=0.04),
    _rec("scaledsign", "efsignsgd:momentum=0.9", "sgd",
         "as efsignsgd, of which it is the quantizer", lr_scale=0.2),
    _rec("efsignsgd", "efsignsgd:momentum=0.9", "sgd",
         "EF-signSGD (Karimireddy et al. 2019) with momentum correction; the rate "
         "divided by 5 for the ~1/(1-m) larger velocity it compresses", lr_scale=0.2),
    _rec("qsgd", "qsgd:levels=127,bucket_size=512", "momentum",
         "QSGD (Alistarh et al. 2017), 8 bits, bucket 512: the paper's full-accuracy "
         "setting, with momentum SGD as in its experiments"),
    _rec("terngrad", "terngrad:clip=2.5", "momentum",
         "TernGrad (Wen et al. 2017): 2.5-sigma clipping, the dense optimizer"),
    _rec("dgc", "dgc:ratio=0.001,warmup_steps={steps_per_epoch}", "sgd",
         "DGC (Lin et al. 2018): 99.9 % sparsity reached by an exponential warm-up of "
         "one stage per epoch (75 %, 93.75 %, 98.4 %, 99.6 %), momentum 0.9 with "
         "momentum correction and factor masking on the workers"),
    _rec("importance", "importance:ratio=0.01", "momentum",
         "importance-weighted pruning (Cheng & Xu 2019), error feedback, the dense "
         "optimizer (benchmarks/results/ablation_importance.md)"),
    _rec("powersgd", "powersgd:rank=2", "momentum",
         "PowerSGD (Vogels et al. 2019): rank 2, warm start, error feedback, with the "
         "momentum in the optimizer as in the paper"),
    _rec("graddrop", "graddrop:drop_ratio=0.99", "momentum",
         "gradient dropping (Aji & Heafield 2017): 99 % dropped, error feedback"),
    _rec("threshold", "threshold:tau=0.01,max_density=0.01", "momentum",
         "Strom (2015)'s fixed threshold: tau depends on the gradients' scale, which "
         "the model sets; tune it so that about 1 % of the entries pass"),
    _rec("adaptive", "adaptive:proportion=100", "momentum",
         "adaptive quantization (Dryden et al. 2016): the top and bottom 1 % of each "
         "tensor, error feedback"),
    _rec("fft", "fft:theta=0.9,bits=8", "momentum",
         "FFT sparsification (Wang et al. 2020): 90 % of the spectrum dropped, 8-bit "
         "range-based floats"),
    _rec("variance", "variance:alpha=2.0,zeta=0.999", "momentum",
         "variance-based compression (Tsuzuku et al. 2018) at the paper's alpha and "
         "zeta"),
    _rec("gradiveq", "gradiveq", "momentum",
         "GradiVeQ (Yu et al. 2018): convolutions only, fully connected layers dense, as "
         "the paper"),
]

_BY_NAME = {r.name: r for r in _TABLE}


def recommended(name: str) -> Recommendation:
    """The recommended setting for the registry compressor ``name`` (``"dgc"``).

    A compressor string is accepted too: its name decides (``"dgc:ratio=0.01"`` gives
    dgc's setting, ``"ef+topk"`` error feedback's).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"`name` must be a compressor name such as 'dgc', got {name!r}")
    parts = _head(name)
    # "ef+topk" is error feedback's own setting; "ef+randomk" random-k's (with memory).
    key = "ef" if parts[-1] == "topk" and parts[0] == "ef" else parts[-1]
    if key not in _BY_NAME:
        close = difflib.get_close_matches(key, list(_BY_NAME), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"no recommended setting for {name!r}{hint}; known: "
                         f"{', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[key]


def _head(spec):
    return [p.strip() for p in spec.strip().partition(":")[0].lower().split("+")]


def resolve(compressor: str, steps_per_epoch: Optional[int] = None) -> str:
    """The compressor string to train with under ``--recommended``.

    A bare name (no ``:``) whose compressor the recommendation also names becomes the
    recommended string (``"dgc"`` -> ``"dgc:ratio=0.001,warmup_steps=<steps>"``,
    ``"randomk"`` -> ``"ef+randomk:ratio=0.01"``); a string with hyperparameters, or
    one that composes differently (``"ef+qsgd"``), is the user's choice and stays.
    Without ``steps_per_epoch`` the recommended string keeps its ``{steps_per_epoch}``
    placeholder, if it has one (``needs_steps_per_epoch`` says so; the
    recommendation's ``spec(steps)`` fills it in).
    """
    rec = recommended(compressor)
    mine, theirs = _head(compressor), _head(rec.compressor)
    same = mine == theirs or (len(mine) == 1 and mine[0] in (theirs[-1], rec.name))
    if ":" in compressor or not same:
        return compressor.strip()
    return rec.compressor if steps_per_epoch is None else rec.spec(steps_per_epoch)


def needs_steps_per_epoch(compressor: str) -> bool:
    """Whether ``compressor`` still holds the ``{steps_per_epoch}`` placeholder."""
    return "{steps_per_epoch}" in compressor


def recommended_settings():
    """Every recommendation, in the README's order."""
    return list(_TABLE)
