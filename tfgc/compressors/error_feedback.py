"""Error feedback (memory) around any compressor.

Per worker and per gradient, with residual e (zero at the start):

  1. v = g + e
  2. payload = C(v)
  3. e <- v - decode(payload)

so nothing a compressor drops is lost: summed over steps, what was applied plus the
final residual equals the sum of the gradients (Seide et al. 2014; Karimireddy et al.
2019; Stich et al. 2018). Compression then behaves like delayed, not discarded,
updates, which is what lets 1-bit and top-k reach full accuracy.

With ``momentum=m`` the momentum moves from the optimizer onto the workers, before
compression (momentum correction, Lin et al. 2018; for quantizers with error
feedback at the worker and at the server, Zheng, Huang & Kwok 2019,
"dist-EF-SGDM"): u <- m u + g, then v = u + e as above, and the optimizer applies
the decoded sum with no momentum of its own. What waits in the residuals has then
been through the momentum once, not again at every step it waits, which is what a
second residual (the reduce-scatter's owner) needs. Unlike DGC, nothing is masked:
a quantizer sends every entry.
"""

import tensorflow as tf

from tfgc.compressors.base import Compressor, check_momentum, momentum_step
from tfgc.compressors.protocols import WIRE_PARTS
from tfgc.compressors.sparse import TopK


def _inner(name):
    """A property that reads the inner compressor's ``name``."""
    return property(lambda self: getattr(self.inner, name))


class ErrorFeedback(Compressor):
    """Wraps ``compressor`` with a per-gradient residual.

    Args:
      compressor: the inner compressor: an instance (default: ``TopK()``, 1 %), a
        registry string or a config dict (``{"name": ..., "config": {...}}``).
      momentum: momentum applied on the workers before compression (momentum
        correction), in [0, 1). 0 (the default) leaves momentum to the optimizer;
        with m > 0 compile the model with plain SGD, which the strategy checks.
        In registry strings it goes with the inner compressor's arguments:
        ``"onebit:momentum=0.9"``, ``"ef+topk:ratio=0.01,momentum=0.9"``.
      nesterov: Nesterov momentum, as for DGC.

    The payload and its combination rule are the inner compressor's, so
    ``ErrorFeedback(RandomK())`` stays summable.
    """

    name = "ef"
    # The wrapper's own arguments; a registry string's other arguments are the inner's.
    wrapper_args = ("momentum", "nesterov")

    # Turns a registry string or config dict into the inner compressor. The registry sets
    # it when it is imported: it parses both, and it imports this module, so this module
    # does not import it back.
    parse_inner = None

    def __init__(self, compressor=None, momentum: float = 0.0, nesterov: bool = False):
        if compressor is None:
            inner = TopK()
        elif isinstance(compressor, Compressor):
            inner = compressor
        elif ErrorFeedback.parse_inner is not None:
            inner = ErrorFeedback.parse_inner(compressor)
        else:
            raise TypeError(f"`compressor` must be a Compressor, got {compressor!r}")
        if isinstance(inner, ErrorFeedback):
            raise ValueError("`compressor` is already wrapped in ErrorFeedback")
        if inner.keeps_residual:
            raise ValueError(f"`compressor` {inner.name!r} keeps its own residual; use it "
                             "without error feedback (no `ef+`)")
        if inner.plans_per_tensor:
            raise ValueError(f"`compressor` {inner.name!r} plans each gradient's encoding "
                             "(its low-rank and top-k candidates with error feedback of "
                             "their own); use it without `ef+`")
        if inner.stage_period:
            raise ValueError(f"`compressor` {inner.name!r} learns from the aggregated "
                             "gradients and runs without error feedback (no `ef+`)")
        self.inner = inner
        self.momentum = check_momentum(momentum, nesterov)
        self.nesterov = nesterov

    @property
    def applied_momentum(self) -> float:
        return self.momentum

    @property
    def error_feedback(self):
        """This wrapper: the error-feedback pair (``protocols.ErrorFeedbackPair``)."""
        return self

    # The payload, its combination rule and what the inner compressor reads are the
    # inner compressor's; so are the parts that describe the payload (WIRE_PARTS,
    # set below the class).
    summable = _inner("summable")
    combines_by_sum = _inner("combines_by_sum")
    needs_weights = _inner("needs_weights")
    fuses_gradients = _inner("fuses_gradients")
    needs_second_moment = _inner("needs_second_moment")

    def get_config(self):
        config = {"compressor": {"name": self.inner.name, "config": self.inner.get_config()}}
        if self.momentum:
            # Only when set, so that configs (and state keys) without it stay as they were.
            config.update(momentum=self.momentum, nesterov=self.nesterov)
        return config

    def supports(self, shape, dtype):
        return self.inner.supports(shape, dtype)

    def init_state(self, shape, dtype):
        state = {"residual": tf.zeros(shape, dtype),
                 "inner": self.inner.init_state(shape, dtype)}
        if self.momentum:
            state["momentum"] = tf.zeros(shape, dtype)
        return state

    def diagnostics(self, state, step=None):
        """The inner compressor's figures, and ``momentum_norm`` (the l2 norm of the
        velocity u) per gradient when momentum is applied on the workers. The residual
        is the state's ``residual``, which the stats callback reports itself."""
        out = dict(self.inner.diagnostics(None if state is None else state["inner"], step))
        if state is not None and self.momentum and "momentum" in state:
            out["momentum_norm"] = tf.norm(tf.cast(state["momentum"], tf.float32))
        return out

    def corrected(self, x, state):
        """Momentum correction of ``x``: ``(what to compress, the new state entries)``.

        Without momentum, ``(x, {})``. The reduce-scatter, which reads the residual
        itself, calls this too.
        """
        if not self.momentum:
            return x, {}
        add, u = momentum_step(x, state["momentum"], self.momentum, self.nesterov)
        return add, {"momentum": u}

    def compress(self, x, state, ctx):
        x, extra = self.corrected(x, state)
        payload, inner_state, residual = self.inner.compress_with_feedback(
            x, state["residual"], state["inner"], ctx)
        return payload, {"residual": residual, "inner": inner_state, **extra}

    def decompress(self, payload, shape, dtype, ctx):
        return self.inner.decompress(payload, shape, dtype, ctx)

    def aggregate(self, payloads, shape, dtype, ctx):
        return self.inner.aggregate(payloads, shape, dtype, ctx)


def _wire_part(name):
    """The inner compressor's part ``name``; the owner's recompression only while the
    inner compressor is stateless (its second compression keeps no state)."""
    def get(self):
        part = getattr(self.inner, name)
        if name == "chunk_recompression" and part is not None and tf.nest.flatten(
                self.inner.init_state(tf.TensorShape([1]), tf.float32)):
            return None
        return part
    return property(get, doc=f"The inner compressor's ``{name}`` part.")


for _name in WIRE_PARTS:
    setattr(ErrorFeedback, _name, _wire_part(_name))
