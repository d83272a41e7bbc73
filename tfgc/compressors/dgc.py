"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018).

Per worker and per gradient, with velocity u and accumulator v (both zero at first),
momentum m and density d:

  1. local gradient clipping: g <- g * min(1, c / ||g||) with c = clip_norm / sqrt(N);
  2. momentum correction: u <- m u + g; v <- v + u (Nesterov: u <- m (u + g);
     v <- v + u + g);
  3. sparsification: send the k = ceil(d n) entries of v of largest magnitude, the
     threshold estimated from a sample; v <- v with the sent entries zeroed;
  4. momentum factor masking: u <- u with the sent entries zeroed;
  5. warm-up: d is 1/4, 1/16, 1/64, ... (each stage a quarter of the one before) for
     ``warmup_steps`` steps each, until the next would fall below ``ratio``.

The workers' sparse v are summed and the optimizer applies the sum with *no further
momentum*: DGC moves the momentum from the optimizer to the workers, so that what
waits in v has already been through it. The optimizer must therefore be plain SGD;
the strategy stops with a message if it applies momentum of its own (see
``applied_momentum``). Gradients that are not compressed (biases and other small
tensors, which ``CompressionPolicy`` sends dense) get the same momentum after their
all-reduce, so every variable trains with momentum m. With ratio = 1 nothing is
masked and DGC is dense momentum SGD.

Choices where the paper leaves room, taken from the authors' code
(synxlin/deep-gradient-compression, ``dgc/memory.py`` and ``dgc/compression.py``):
clipping is per tensor (the code's ``clip_grad_norm_`` on each gradient); the
threshold comes from a sample of ``sample_ratio`` of the entries, lowered by 0.8 while
fewer than 0.8 k pass and refined to the exact top k when more than 1.3 k pass
(``tfgc.ops.sparsify``). The code then sends the first k of the selected entries by
position; tfgc sends the k largest and keeps the others in v, and pads a selection
short of k with zeros, so every payload holds exactly k entries. The warm-up counts
steps, not epochs: pass ``warmup_steps`` = steps per epoch for the paper's schedule
(one epoch per stage in the authors' configurations).
"""

import math

import tensorflow as tf

from tfgc.compressors.base import (check_int, check_momentum, check_ratio, momentum_step,
                                   num_elements)
from tfgc.compressors.sparse import TopK, _k_for, keep_largest
from tfgc.ops import sparsify

# The paper's warm-up divides the density by 4 per stage, starting at 25 %.
_WARMUP_FIRST, _WARMUP_FACTOR = 0.25, 4.0
_SEED = 0xD6C


class DGC(TopK):
    """Deep Gradient Compression: momentum correction, clipping, masking, warm-up.

    Args:
      ratio: density after warm-up, in (0, 1]. Default 0.001 (the paper's 99.9 %
        sparsity).
      momentum: momentum m applied on the workers (momentum correction), in [0, 1).
        Default 0.9. Compile the model with plain SGD (``momentum=0``); pass 0 here
        to keep an optimizer's own momentum (then DGC sparsifies the accumulated
        gradient, without momentum correction).
      nesterov: Nesterov momentum, as the authors' code formulates it.
      clip_norm: local gradient clipping: each worker clips each gradient's l2 norm
        to ``clip_norm / sqrt(N)`` before accumulating. 0 (the default) disables it.
      momentum_masking: zero u where v was sent (momentum factor masking).
      sample_ratio: fraction of the entries sampled to estimate the threshold, in
        (0, 1]; 1 selects the exact top k. Default 0.01, the authors' code.
      warmup_steps: steps per warm-up stage; 0 (the default) starts at ``ratio``.

    Wire: k float values and k int32 indices per gradient, as top-k.
    """

    name = "dgc"
    # Each worker's index set is its own (the residual and the momentum mask follow it).
    index_selection = None
    keeps_residual = True

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, nesterov: bool = False,
                 clip_norm: float = 0.0, momentum_masking: bool = True,
                 sample_ratio: float = 0.01, warmup_steps: int = 0):
        super().__init__(ratio=ratio)
        self.momentum = check_momentum(momentum, nesterov)
        if not isinstance(momentum_masking, bool):
            raise ValueError(f"`momentum_masking` must be a bool, got {momentum_masking!r}")
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) \
                or not 0.0 <= float(clip_norm) < float("inf"):
            raise ValueError(f"`clip_norm` must be a finite number >= 0, got {clip_norm!r}")
        self.nesterov = nesterov
        self.clip_norm = float(clip_norm)
        self.momentum_masking = momentum_masking
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)

    @property
    def applied_momentum(self) -> float:
        return self.momentum

    # -- warm-up --------------------------------------------------------------------

    def warmup_densities(self):
        """The densities of the warm-up stages: 1/4, 1/16, ... while above ``ratio``."""
        if not self.warmup_steps:
            return []
        out, d = [], _WARMUP_FIRST
        while d > self.ratio:
            out.append(d)
            d /= _WARMUP_FACTOR
        return out

    def density_at(self, step: int) -> float:
        """The density used at reduction ``step`` (0-based)."""
        densities = self.warmup_densities()
        stage = step // self.warmup_steps if self.warmup_steps else 0
        return densities[stage] if stage < len(densities) else self.ratio

    def stages(self):
        """``[(first step, compressor)]`` of the warm-up, the last at ``ratio``; [] without."""
        densities = self.warmup_densities()
        if not densities:
            return []
        config = self.get_config()
        config["warmup_steps"] = 0
        out = []
        for i, d in enumerate(densities + [self.ratio]):
            out.append((i * self.warmup_steps, type(self)(**{**config, "ratio": d})))
        return out

    def diagnostics(self, state, step=None):
        """DGC's figures.

        * compressor-wide (``state`` None): ``density``, the density d of the last
          applied reduction, by the warm-up schedule and the step counter (the
          first reduction's before any); ``ratio`` without warm-up, whatever the
          step; nothing with warm-up and no ``step``;
        * per gradient: ``momentum_norm``, the l2 norm of the velocity u (after
          masking), when the compressor applies momentum. The accumulator v is
          the state's ``residual``, which the stats callback reports itself.
        """
        if state is not None:
            if not self.momentum or "momentum" not in state:
                return {}
            return {"momentum_norm": tf.norm(tf.cast(state["momentum"], tf.float32))}
        densities = self.warmup_densities() + [self.ratio]
        if len(densities) == 1:
            return {"density": tf.constant(self.ratio, tf.float32)}
        if step is None:
            return {}
        # The reduction at counter value c ran at density_at(c); the counter has
        # moved on by one since the last one that was applied.
        last = tf.maximum(tf.cast(step, tf.int64) - 1, 0)
        stage = tf.minimum(last // self.warmup_steps, len(densities) - 1)
        return {"density": tf.gather(tf.constant(densities, tf.float32), stage)}

    # -- the algorithm ----------------------------------------------------------------

    def init_state(self, shape, dtype):
        return {"momentum": tf.zeros(shape, dtype), "residual": tf.zeros(shape, dtype)}

    def num_kept(self, shape) -> int:
        return _k_for(num_elements(shape), self.ratio, 0)

    def compress(self, x, state, ctx):
        g = x
        if self.clip_norm:
            limit = self.clip_norm / math.sqrt(max(1, ctx.num_workers))
            g = tf.clip_by_norm(g, tf.cast(limit, g.dtype))
        v = state["residual"]
        add, u = momentum_step(g, state["momentum"], self.momentum, self.nesterov)
        n, k = num_elements(x.shape), self.num_kept(x.shape)
        if k >= n:
            # Everything is sent: nothing waits, nothing is masked.
            return (tf.reshape(add + v, [-1]), tf.range(n, dtype=tf.int32)), {
                "momentum": u, "residual": tf.zeros_like(v)}
        exact = self.sample_ratio >= 1.0
        seed = ctx.seed(_SEED, shared=False)[0]
        out = sparsify.sparsify_with_residual(
            tf.reshape(add, [-1]), tf.reshape(v, [-1]), k, exact=exact,
            sample_ratio=self.sample_ratio, seed=seed)
        values, picked, new_v = out.values, out.indices, out.new_residual
        if not exact:
            values, picked, new_v = keep_largest(values, picked, new_v, k)
        sent = picked[:, None]
        count = tf.shape(picked)[0]
        if self.momentum and self.momentum_masking:
            u = tf.reshape(tf.tensor_scatter_nd_update(
                tf.reshape(u, [-1]), sent, tf.zeros_like(values)), x.shape)
        # A selection short of k is padded with zeros at the first sent index.
        pad = k - count
        values = tf.ensure_shape(tf.concat([values, tf.zeros([pad], values.dtype)], 0), [k])
        indices = tf.ensure_shape(
            tf.concat([picked, tf.fill([pad], picked[0])], 0), [k])
        return (values, indices), {"momentum": u, "residual": tf.reshape(new_v, x.shape)}

    def compress_with_feedback(self, x, residual, state, ctx):
        raise ValueError("dgc keeps its own residual; use it without `ef+`")
