"""Builds compressors from strings, config dicts or instances.

String form, short enough for a command-line flag::

    "topk:ratio=0.01"            a compressor and its hyperparameters
    "ef+topk:ratio=0.01"         the same, wrapped in error feedback
    "qsgd:levels=7,bucket_size=128"
    "onebit"                     1-bit SGD; error feedback is part of the algorithm
    "onebit:momentum=0.9"        the error feedback's arguments (momentum, nesterov)
                                 go with the compressor's

Dict form (what ``serialize_config`` returns and ``get`` accepts)::

    {"name": "ef", "config": {"compressor": {"name": "topk", "config": {"ratio": 0.01, "k": 0}}}}
"""

import difflib
import inspect
from typing import Any, Dict, Type

from tfgc.compressors.auto import Auto
from tfgc.compressors.base import Compressor
from tfgc.compressors.casts import BF16, FP16, Identity
from tfgc.compressors.dgc import DGC
from tfgc.compressors.error_feedback import ErrorFeedback
from tfgc.compressors.fft import FFT
from tfgc.compressors.gradiveq import GradiVeQ
from tfgc.compressors.powersgd import PowerSGD
from tfgc.compressors.quantizers import QSGD, OneBit, ScaledSign, SignSGD, TernGrad
from tfgc.compressors.sparse import Importance, RandomK, TopK
from tfgc.compressors.thresholds import Adaptive, GradientDropping, Threshold
from tfgc.compressors.variance import Variance

_REGISTRY: Dict[str, Type[Compressor]] = {}

# Names that mean a composition: the paper's algorithm is the quantizer plus memory.
_ALIASES = {"efsignsgd": "ef+scaledsign"}


def register(cls: Type[Compressor]) -> Type[Compressor]:
    """Adds a compressor class under ``cls.name``; usable as a decorator."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a compressor named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (Auto, Identity, FP16, BF16, TopK, RandomK, OneBit, SignSGD, ScaledSign, QSGD, TernGrad,
             ErrorFeedback, DGC, PowerSGD, Importance, GradientDropping, Threshold, Adaptive, FFT, Variance,
             GradiVeQ):
    register(_cls)


def names():
    """All names ``get`` accepts."""
    return sorted(set(_REGISTRY) | set(_ALIASES))


def shared_state_fields() -> frozenset:
    """The state fields that some registered compressor holds alike on every worker
    (``Compressor.shared_state``), by their last path component."""
    return frozenset(field for cls in _REGISTRY.values() for field in cls.shared_state)


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _did_you_mean(word: str, options) -> str:
    """' (did you mean 'x'?)' for the closest of ``options``, or ''."""
    close = difflib.get_close_matches(word.lower(), list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _build(name: str, config: Dict[str, Any]) -> Compressor:
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}{_did_you_mean(name, names())}; "
                         f"known: {', '.join(names())}")
    cls = _REGISTRY[name]
    params = inspect.signature(cls.__init__).parameters
    for key in config:
        if key not in params or key == "self":
            allowed = [p for p in params if p not in ("self", "args", "kwargs")]
            raise ValueError(f"compressor {name!r} has no hyperparameter "
                             f"`{key}`{_did_you_mean(key, allowed)}; "
                             f"it takes: {', '.join(allowed) or 'none'}")
    return cls(**config)


def _parse_string(spec: str) -> Compressor:
    spec = spec.strip()
    if not spec:
        raise ValueError("empty compressor string")
    head, _, args = spec.partition(":")
    parts = [q.strip() for p in head.split("+") for q in _ALIASES.get(p.strip(), p).split("+")]
    if any(not p for p in parts):
        raise ValueError(f"malformed compressor string {spec!r}")
    wrappers, base = parts[:-1], parts[-1]
    config = {}
    if args.strip():
        for item in args.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"malformed hyperparameter {item!r} in {spec!r}: expected key=value")
            if key.strip() in config:
                raise ValueError(f"hyperparameter `{key.strip()}` given twice in {spec!r}")
            config[key.strip()] = _parse_value(value.strip())
    for wrapper in wrappers:
        if wrapper != "ef":
            raise ValueError(f"unknown wrapper {wrapper!r} in {spec!r}; known: ef "
                             "(error feedback, as in 'ef+topk')")
    cls = _REGISTRY.get(base)
    wrapped = bool(wrappers) or (cls is not None and cls.requires_error_feedback)
    own = inspect.signature(cls.__init__).parameters if cls is not None else {}
    feedback = {key: config.pop(key) for key in ErrorFeedback.wrapper_args
                if key in config and key not in own}
    if feedback and not wrapped:
        raise ValueError(f"compressor {base!r} has no hyperparameter "
                         f"`{next(iter(feedback))}`; worker-side momentum comes with error "
                         f"feedback: 'ef+{spec}'")
    compressor = _build(base, config)
    if wrapped:
        compressor = ErrorFeedback(compressor, **feedback)
    return compressor


def get(identifier=None, wrap_error_feedback: bool = True) -> Compressor:
    """Returns a compressor for a name/string, a config dict, an instance or None.

    None means no compression (``"none"``). Compressors whose algorithm includes
    error feedback (1-bit SGD, EF-signSGD) come wrapped in ``ErrorFeedback`` unless
    ``wrap_error_feedback=False``, whichever form names them: ``get(OneBit())``
    equals ``get("onebit")``. Any other instance, an ``ErrorFeedback`` included, is
    returned as it is.
    """
    if identifier is None:
        compressor = Identity()
    elif isinstance(identifier, Compressor):
        compressor = identifier
    elif isinstance(identifier, str):
        compressor = _parse_string(identifier)
    elif isinstance(identifier, dict):
        if set(identifier) - {"name", "config"} or "name" not in identifier:
            raise ValueError("a compressor config dict has keys 'name' and optionally 'config', "
                             f"got {sorted(identifier)}")
        config = identifier.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"compressor 'config' must be a dict, got {config!r}")
        name = _ALIASES.get(identifier["name"], identifier["name"])
        compressor = _parse_string(name) if "+" in name else _build(name, dict(config))
        if "+" in name and config:
            raise ValueError("an alias or wrapped name takes no 'config'; nest it instead")
    else:
        raise ValueError(f"cannot build a compressor from {identifier!r}")
    if (wrap_error_feedback and compressor.requires_error_feedback
            and not isinstance(compressor, ErrorFeedback)):
        compressor = ErrorFeedback(compressor)
    return compressor


# ErrorFeedback's inner compressor may be named by a string or a config dict.
ErrorFeedback.parse_inner = staticmethod(lambda spec: get(spec, wrap_error_feedback=False))


def serialize_config(compressor: Compressor) -> Dict[str, Any]:
    """``{"name": ..., "config": ...}`` such that ``get`` rebuilds an equal compressor."""
    return {"name": compressor.name, "config": compressor.get_config()}


def serialize(compressor: Compressor) -> str:
    """The string form, e.g. ``"ef+topk:k=0,ratio=0.01"``; ``get`` parses it back."""
    prefix, extra = "", {}
    if isinstance(compressor, ErrorFeedback):
        extra = {k: v for k, v in compressor.get_config().items() if k != "compressor"}
        prefix, compressor = "ef+", compressor.inner
    config = {**compressor.get_config(), **extra}
    for key, value in config.items():
        if isinstance(value, str) and any(c in value for c in ",=:+"):
            raise ValueError(f"hyperparameter `{key}`={value!r} cannot be written as a string")
    args = ",".join(f"{k}={v}" for k, v in sorted(config.items()))
    return prefix + compressor.name + (":" + args if args else "")


def _defaults(fn) -> Dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def describe(compressor: Compressor) -> str:
    """The shortest string that ``get`` turns into an equal compressor: hyperparameters
    left at their defaults are left out, and so is ``ef+`` where the compressor always
    comes with error feedback (``"onebit"``, ``"ef+topk:ratio=0.01"``). For logs and
    tables; ``serialize`` gives the full form."""
    original = compressor
    prefix, extra = "", {}
    if isinstance(compressor, ErrorFeedback):
        defaults = _defaults(ErrorFeedback.__init__)
        extra = {k: v for k, v in compressor.get_config().items()
                 if k != "compressor" and defaults.get(k, inspect.Parameter.empty) != v}
        prefix = "" if compressor.inner.requires_error_feedback else "ef+"
        compressor = compressor.inner
    defaults = _defaults(type(compressor).__init__)
    config = {k: v for k, v in compressor.get_config().items()
              if defaults.get(k, inspect.Parameter.empty) != v}
    config.update(extra)
    for key, value in config.items():
        if isinstance(value, str) and any(c in value for c in ",=:+"):
            raise ValueError(f"hyperparameter `{key}`={value!r} cannot be written as a string")
    args = ",".join(f"{k}={v}" for k, v in sorted(config.items()))
    text = prefix + compressor.name + (":" + args if args else "")
    if get(text) != original:
        return serialize(original)
    return text
