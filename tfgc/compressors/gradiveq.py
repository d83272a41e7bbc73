"""GradiVeQ: gradient vector quantization by a PCA learned online (Yu et al., NeurIPS 2018).

A gradient is cut into slices of K entries; each slice g is sent as its projection
U_d^T (g - mu / N) on the top d principal directions of recent aggregated slices.
The projection is linear, so the workers' projections add up in a plain all-reduce
to U_d^T (sum g - mu), and the receiver decompresses once: U_d (sum) + mu.

Layout: a convolution kernel [H, W, D, F] flattened row-major has each spatial
position's D x F block contiguous (filters fastest, then depth, then width, then
height, as the paper lays it out). Where a block fits in ``slice_size`` (the paper's
networks, 16 to 64 channels), a slice is a whole number of blocks: K = D F c with
c = round(``slice_size`` / (D F)), at least 1 and at most H W. A wider layer is cut
into tiles of t_D channels by t_F filters (``tiles``), and a slice holds one tile at
c collocated positions, K = t_D t_F c near ``slice_size``: ResNet-50's [3, 3, 512,
512] kernel would otherwise make K = 262,144 and a K x K covariance of 275 GB.
Memory is then O(``slice_size`` x (``learn_steps`` + ``max_dim``)) per layer whatever its
width. The paper leaves fully-connected
layers uncompressed; ``dense_layers=True`` compresses 2-D kernels too, in flat slices
of ``slice_size``. Padding (of the last slice, or of a tile row) is zeros.

Learning the compressor, in cycles of ``learn_steps`` + ``compress_steps`` steps:

* learning steps send the gradient uncompressed (one all-reduce); every worker stores
  the first slice of the *aggregated* gradient as a row of its samples, so every worker holds
  the same samples (the paper's reuse factor s = infinity: one compressor per
  layer, learned from its first slice);
* at the last learning step every worker computes mu (the samples' mean) and the
  eigenvectors of their covariance, and keeps the smallest d whose eigenvalues hold
  at least 1 - ``energy`` of the total (the lambda rule), at most ``max_dim``;
  identical inputs on identical code give the same U_d and mu on every worker;
* compressing steps send d' = ``max_dim`` floats per slice, the directions past d
  set to zero (payload shapes are static in tfgc, so the wire carries ``max_dim``
  whatever d the rule picks; the figures report it).

The paper's learning steps may send 4-bit QSGD instead of raw gradients; tfgc sends
them raw, so a cycle's mean ratio is (L_t + L_c) / (L_t + L_c d'/K). No error
feedback, as in the paper.
"""

import math

import tensorflow as tf

from tfgc.compressors.base import Compressor, check_fraction, check_int, num_elements


class GradiVeQ(Compressor):
    """GradiVeQ (see the module docstring).

    Args:
      slice_size: target slice length K, >= 2. Default 768 (the paper's 3 x 16 x 16).
      energy: lambda; U_d keeps at least 1 - lambda of the samples' variance, in
        [0, 1). Default 0.01 (the paper's).
      max_dim: d', the floats sent per slice (d <= d'), in [1, K]. Default 96 (K / 8,
        the paper's average compression per slice).
      learn_steps: L_t, uncompressed steps that collect samples, >= 2. Default 100.
      compress_steps: L_c, compressed steps per cycle, >= 1. Default 400.
      dense_layers: also compress 2-D kernels (the paper leaves them uncompressed).

    Wire per compressed gradient: d' floats per slice, all-reduced; on learning
    steps the raw gradient.
    """

    name = "gradiveq"
    summable = True
    # Learned from the aggregated gradients: the same on every worker.
    shared_state = ("basis", "mean", "samples", "count")

    def __init__(self, slice_size: int = 768, energy: float = 0.01, max_dim: int = 96,
                 learn_steps: int = 100, compress_steps: int = 400, dense_layers: bool = False):
        self.slice_size = check_int("slice_size", slice_size, 2)
        self.energy = check_fraction("energy", energy)
        self.max_dim = check_int("max_dim", max_dim, 1, slice_size)
        self.learn_steps = check_int("learn_steps", learn_steps, 2)
        self.compress_steps = check_int("compress_steps", compress_steps, 1)
        if not isinstance(dense_layers, bool):
            raise ValueError(f"`dense_layers` must be a bool, got {dense_layers!r}")
        self.dense_layers = dense_layers
        self.phase = "cycle"

    # -- layout ---------------------------------------------------------------------

    def tiles(self, shape):
        """(c, t_D, t_F) for a convolution kernel wider than a slice, else None.

        Tiles start square, t = the largest power of two with t^2 <= ``slice_size``
        (16 for 768: the paper's 3 x 16 x 16), and a narrow side gives its room to the
        other; each side is then evened out so that padding stays under one tile row.
        """
        dims = shape.as_list()
        if len(dims) != 4 or dims[2] * dims[3] <= self.slice_size:
            return None
        positions, depth, filters = dims[0] * dims[1], dims[2], dims[3]
        t = 1 << (int(math.isqrt(self.slice_size)).bit_length() - 1)
        t_f = _even(filters, max(t, self.slice_size // min(depth, t)))
        t_d = _even(depth, max(1, self.slice_size // t_f))
        c = min(positions, max(1, int(round(self.slice_size / (t_d * t_f)))))
        return c, t_d, t_f

    def _grid(self, shape):
        """(c, t_D, t_F, position groups, channel tiles, filter tiles) of a tiled kernel,
        else None."""
        tiles = self.tiles(shape)
        if tiles is None:
            return None
        c, t_d, t_f = tiles
        h, w, depth, filters = shape.as_list()
        return c, t_d, t_f, -(-h * w // c), -(-depth // t_d), -(-filters // t_f)

    def slice_length(self, shape) -> int:
        tiles = self.tiles(shape)
        if tiles is not None:
            c, t_d, t_f = tiles
            return c * t_d * t_f
        dims = shape.as_list()
        if len(dims) == 4:
            # At most every position: a small kernel is one slice, unpadded.
            unit = dims[2] * dims[3]
            return unit * min(dims[0] * dims[1], max(1, int(round(self.slice_size / unit))))
        return min(self.slice_size, num_elements(shape))

    def dims(self, shape):
        """(K, slices, d') for a gradient of ``shape``."""
        k = self.slice_length(shape)
        grid = self._grid(shape)
        if grid is None:
            slices = -(-num_elements(shape) // k)
        else:
            _, _, _, p, nd, nf = grid
            slices = p * nd * nf
        return k, slices, min(self.max_dim, k)

    def supports(self, shape, dtype):
        if not super().supports(shape, dtype):
            return False
        rank = len(shape.as_list())
        return rank == 4 or (self.dense_layers and rank == 2)

    def _slices(self, x):
        """``x`` as its [slices, K] matrix, float32."""
        k, slices, _ = self.dims(x.shape)
        layout = self._grid(x.shape)
        if layout is None:
            flat = tf.cast(tf.reshape(x, [-1]), tf.float32)
            flat = tf.pad(flat, [[0, slices * k - num_elements(x.shape)]])
            return tf.reshape(flat, [slices, k])
        c, t_d, t_f, p, nd, nf = layout
        h, w, depth, filters = x.shape.as_list()
        grid = tf.reshape(tf.cast(x, tf.float32), [h * w, depth, filters])
        grid = tf.pad(grid, [[0, p * c - h * w], [0, nd * t_d - depth], [0, nf * t_f - filters]])
        grid = tf.reshape(grid, [p, c, nd, t_d, nf, t_f])
        # Tile by tile (channel tile, filter tile), then by group of c positions.
        return tf.reshape(tf.transpose(grid, [2, 4, 0, 1, 3, 5]), [slices, k])

    def _first_slice(self, x):
        """``_slices(x)[0]`` without building the others (a learning step's sample)."""
        k, _, _ = self.dims(x.shape)
        tiles = self.tiles(x.shape)
        if tiles is None:
            first = tf.cast(tf.reshape(x, [-1])[:k], tf.float32)
            return tf.pad(first, [[0, k - int(first.shape[0])]])
        c, t_d, t_f = tiles
        h, w, depth, filters = x.shape.as_list()
        block = tf.cast(tf.reshape(x, [h * w, depth, filters])[:c, :t_d, :t_f], tf.float32)
        block = tf.pad(block, [[0, c - int(block.shape[0])], [0, t_d - int(block.shape[1])],
                               [0, t_f - int(block.shape[2])]])
        return tf.reshape(block, [k])

    def _unslice(self, rows, shape, dtype):
        """Inverse of ``_slices``: the [slices, K] matrix back to ``shape`` and ``dtype``."""
        layout = self._grid(shape)
        if layout is None:
            flat = tf.reshape(rows, [-1])[:num_elements(shape)]
            return tf.reshape(tf.cast(flat, dtype), shape)
        c, t_d, t_f, p, nd, nf = layout
        h, w, depth, filters = shape.as_list()
        grid = tf.transpose(tf.reshape(rows, [nd, nf, p, c, t_d, t_f]), [2, 3, 0, 4, 1, 5])
        grid = tf.reshape(grid, [p * c, nd * t_d, nf * t_f])[:h * w, :depth, :filters]
        return tf.reshape(tf.cast(grid, dtype), shape)

    # -- schedule ---------------------------------------------------------------------

    @property
    def stage_period(self) -> int:
        return self.learn_steps + self.compress_steps if self.phase == "cycle" else 0

    def _in_phase(self, phase):
        stage = GradiVeQ(**self.get_config())
        stage.phase = phase
        return stage

    def stages(self):
        if self.phase != "cycle":
            return []
        return [(0, self._in_phase("learn")), (self.learn_steps, self._in_phase("compress"))]

    def __repr__(self):
        base = super().__repr__()
        return base if self.phase == "cycle" else f"{base}[{self.phase}]"

    # -- state ------------------------------------------------------------------------

    def init_state(self, shape, dtype):
        # The window's samples themselves, one row per learning step: L_t x K floats
        # (307 KB at the defaults) where a running K x K covariance would be 2.4 MB and
        # a K x K update every learning step; the covariance is formed once, at the
        # window's last step.
        k, _, d = self.dims(shape)
        return {"basis": tf.zeros([k, d]), "mean": tf.zeros([k]),
                "samples": tf.zeros([self.learn_steps, k]), "count": tf.zeros([])}

    def learn_from_samples(self, samples, count):
        """``learn`` on the first ``count`` rows of ``samples`` [L_t, K]."""
        live = tf.cast(tf.range(tf.shape(samples)[0]) < tf.cast(count, tf.int32), tf.float32)
        rows = samples * live[:, None]
        return self.learn(tf.matmul(rows, rows, transpose_a=True), tf.reduce_sum(rows, 0),
                          count)

    def learn(self, samples_cov, samples_sum, count):
        """(basis [K, d'], mean [K], d) from accumulated samples, by the lambda rule."""
        k = int(samples_sum.shape[0])
        d_max = min(self.max_dim, k)
        count = tf.maximum(count, 1.0)
        mean = samples_sum / count
        cov = samples_cov / count - mean[:, None] * mean[None, :]
        cov = (cov + tf.transpose(cov)) / 2.0
        values, vectors = tf.linalg.eigh(tf.cast(cov, tf.float64))
        values = tf.maximum(tf.reverse(values, [0]), 0.0)
        vectors = tf.reverse(vectors, [1])
        total = tf.reduce_sum(values)
        held = tf.cumsum(values) / tf.maximum(total, 1e-300)
        # The smallest d with held[d - 1] >= 1 - lambda (all of them for zero variance).
        d = tf.reduce_sum(tf.cast(held < 1.0 - self.energy, tf.int32)) + 1
        d = tf.where(total > 0, tf.minimum(d, d_max), 1)
        basis = tf.cast(vectors[:, :d_max], tf.float32) * tf.cast(
            tf.range(d_max) < d, tf.float32)[None, :]
        return basis, tf.cast(mean, tf.float32), d

    def diagnostics(self, state, step=None):
        """Per gradient (nothing compressor-wide):

        * ``dim``: d, the directions the lambda rule kept at the last learning
          step, counted as the basis columns that are not zero (the rule zeroes
          the columns past d; an eigenvector never is); 0 before the first basis;
        * ``samples``: the aggregated slices collected in the current learning
          window (in the last one during compressing steps).
        """
        del step
        if state is None or "basis" not in state:
            return {}
        basis = tf.convert_to_tensor(state["basis"])
        kept = tf.reduce_any(tf.not_equal(basis, 0.0), axis=0)
        return {"dim": tf.reduce_sum(tf.cast(kept, tf.int32)),
                "samples": tf.convert_to_tensor(state["count"])}

    # -- the algorithm ----------------------------------------------------------------

    def compress(self, x, state, ctx):
        if self.phase == "learn":
            return (tf.reshape(tf.cast(x, tf.float32), [-1]),), state
        if self.phase != "compress":
            raise ValueError("gradiveq runs in stages; the cross-device ops pick them by step")
        n = max(1, ctx.num_workers)
        centered = self._slices(x) - state["mean"][None, :] / float(n)
        return (tf.reshape(tf.matmul(centered, state["basis"]), [-1]),), state

    def decompress(self, payload, shape, dtype, ctx):
        if self.phase == "learn":
            return tf.reshape(tf.cast(payload[0], dtype), shape)
        raise ValueError("gradiveq decodes with its basis and mean: see `finish`")

    def finish(self, payload, shape, dtype, ctx, state):
        """Decodes the all-reduced payload with this worker's state; on learning steps
        also adds the aggregated gradient's first slice to the samples and, at the
        window's last step, learns U_d and mu from them."""
        (flat,) = payload
        if self.phase == "compress":
            _, slices, d = self.dims(shape)
            projected = tf.reshape(flat, [slices, d])
            rows = tf.matmul(projected, state["basis"], transpose_b=True) + state["mean"][None, :]
            return self._unslice(rows, shape, dtype), state
        out = tf.reshape(tf.cast(flat, dtype), shape)
        # The aggregated gradient's first slice (the first tile's, for a wide layer).
        sample = self._first_slice(tf.reshape(flat, shape))
        period = self.learn_steps + self.compress_steps
        in_window = tf.math.floormod(tf.cast(ctx.step, tf.int64), period)
        # Row i of the window's samples; rows past it are an older window's, left out.
        samples = tf.tensor_scatter_nd_update(state["samples"], tf.reshape(in_window, [1, 1]),
                                              sample[None, :])
        count = tf.cast(in_window + 1, tf.float32)
        basis, mean = tf.cond(tf.equal(in_window, self.learn_steps - 1),
                              lambda: self.learn_from_samples(samples, count)[:2],
                              lambda: (state["basis"], state["mean"]))
        return out, {"basis": basis, "mean": mean, "samples": samples, "count": count}


def _even(n: int, cap: int) -> int:
    """The tile side for ``n`` entries at most ``cap`` long: as many tiles as ``cap``
    needs, each as long as the others (the last padded by less than their number)."""
    return -(-n // -(-n // max(1, cap)))
