"""Error feedback (memory) around any compressor.

Per worker and per gradient, with residual e (zero at the start):

  1. v = g + e
  2. payload = C(v)
  3. e <- v - decode(payload)

so nothing a compressor drops is lost: summed over steps, what was applied plus the
final residual equals the sum of the gradients (Seide et al. 2014; Karimireddy et al.
2019; Stich et al. 2018). Compression then behaves like delayed, not discarded,
updates, which is what lets 1-bit and top-k reach full accuracy.
"""

import tensorflow as tf

from tfgc.compressors.base import Compressor


class ErrorFeedback(Compressor):
    """Wraps ``compressor`` with a per-gradient residual.

    Args:
      compressor: the inner compressor: an instance, a registry string or a config
        dict (``{"name": ..., "config": {...}}``).

    The payload and its combination rule are the inner compressor's, so
    ``ErrorFeedback(RandomK())`` stays summable.
    """

    name = "ef"

    def __init__(self, compressor="topk"):
        from tfgc.compressors import registry  # the registry imports this module
        inner = registry.get(compressor, wrap_error_feedback=False)
        if isinstance(inner, ErrorFeedback):
            raise ValueError("`compressor` is already wrapped in ErrorFeedback")
        if inner.keeps_residual:
            raise ValueError(f"`compressor` {inner.name!r} keeps its own residual; use it "
                             "without error feedback (no `ef+`)")
        self.inner = inner

    @property
    def summable(self):
        return self.inner.summable

    @property
    def selects_indices(self):
        return self.inner.selects_indices

    @property
    def sparse_payload(self):
        return self.inner.sparse_payload

    @property
    def recompressible(self):
        return self.inner.recompressible and not tf.nest.flatten(
            self.inner.init_state(tf.TensorShape([1]), tf.float32))

    def chunk_layout(self, shape, num_ranks):
        return self.inner.chunk_layout(shape, num_ranks)

    def select_indices(self, v, ctx):
        return self.inner.select_indices(v, ctx)

    def num_selected(self, shape):
        return self.inner.num_selected(shape)

    def get_config(self):
        return {"compressor": registry_config(self.inner)}

    def supports(self, shape, dtype):
        return self.inner.supports(shape, dtype)

    def init_state(self, shape, dtype):
        return {"residual": tf.zeros(shape, dtype), "inner": self.inner.init_state(shape, dtype)}

    def compress(self, x, state, ctx):
        payload, inner_state, residual = self.inner.compress_with_feedback(
            x, state["residual"], state["inner"], ctx)
        return payload, {"residual": residual, "inner": inner_state}

    def decompress(self, payload, shape, dtype, ctx):
        return self.inner.decompress(payload, shape, dtype, ctx)

    def aggregate(self, payloads, shape, dtype, ctx):
        return self.inner.aggregate(payloads, shape, dtype, ctx)


def registry_config(compressor):
    from tfgc.compressors import registry
    return registry.serialize_config(compressor)
