"""meProp: a dense layer whose backward pass keeps only the top-k output gradients.

Sun, Ren, Ma and Wang (2017), "meProp: Sparsified Back Propagation for Accelerated
Deep Learning with Reduced Overfitting" (ICML 2017; the authors' code is
lancopku/meProp). The forward pass is an ordinary linear layer, ``y = x W + b``. In
the backward pass, of the gradient ``dy`` with respect to ``y`` (B x m) only k of the
m output coordinates take part in the products that give ``dx`` and ``dW``, so
those cost O(B n k) multiply-adds instead of O(B n m).

Two ways to pick the k coordinates (``mode``):

* ``"unified"`` (the default; the variant the authors added for GPUs, see the
  README of lancopku/meProp, and the only one that is faster than Dense here): one
  index set for the whole batch, ``inds = top-k(sum_b |dy|)``.
  ``dx = dy[:, inds] W[:, inds]^T`` and ``dW[:, inds] = x^T dy[:, inds]``, with zeros
  in the other columns of ``dW``.
* ``"per_example"``: every row of ``dy`` keeps its own k largest magnitudes, the
  rest are zeroed (``dy_k``), and ``dx = dy_k W^T``, ``dW = x^T dy_k``.

This module has no residual, no state across steps and no communication: it only
changes the gradient a layer hands back.
"""

import numbers

import tensorflow as tf
import tf_keras as keras

MODES = ("unified", "per_example")

__all__ = ["MODES", "MePropDense", "meprop_matmul"]


# ------------------------------------------------------------------ validation


def _check_int(name, value, minimum=1):
    # bool is an Integral too, but `k=True` is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {', '.join(repr(m) for m in MODES)}, "
                         f"got {mode!r}")
    return mode


# ------------------------------------------------------- column gather / scatter
#
# The kernel is stored n x m, as keras Dense stores it, so that weights move freely
# between the two layers. The unified backward pass therefore reads k columns of W
# and writes k columns of dW. TensorFlow's CPU kernels for gathers and scatters
# along the last axis go element by element (a dW of 2048 x 2048 took longer to
# assemble that way than the dense matmul it replaces), and transposing to make the
# columns rows costs as much again. Compiled with XLA, both are a single pass over
# the output, so the two helpers below are the only part of the layer that is
# compiled. Their shapes do not involve the batch size, so each layer compiles them
# once.


@tf.function(jit_compile=True, autograph=False)
def _take_columns(w, inds):
    """``w[:, inds]``."""
    return tf.gather(w, inds, axis=1)


@tf.function(jit_compile=True, autograph=False)
def _place_columns(cols, inds, m):
    """The n x m matrix whose column ``inds[j]`` is ``cols[:, j]``, zero elsewhere.

    Written as a gather from ``[0 | cols]`` rather than a scatter into zeros: every
    output column looks up where it comes from (0, the zero column, when it was not
    selected), which XLA turns into one pass over the output.
    """
    k = tf.shape(inds)[0]
    source = tf.scatter_nd(inds[:, None], tf.range(1, k + 1, dtype=inds.dtype), [m])
    padded = tf.pad(cols, [[0, 0], [1, 0]])
    return tf.gather(padded, source, axis=1)


# ----------------------------------------------------------------- the gradients


def _scores(dy):
    """|dy| in a dtype safe to sum over a batch (half precision could overflow)."""
    if dy.dtype in (tf.float16, tf.bfloat16):
        dy = tf.cast(dy, tf.float32)
    return tf.abs(dy)


def unified_backward(x, w, dy, k):
    """(dx, dW) of the unified mode: one set of k output columns for the whole batch.

    ``x`` is B x n, ``w`` n x m, ``dy`` B x m. The columns are the k largest of
    ``sum_b |dy[b, :]|`` (``tf.math.top_k`` breaks ties).
    """
    m = int(w.shape[-1])
    inds = tf.math.top_k(tf.reduce_sum(_scores(dy), axis=0), k, sorted=False).indices
    dy_k = tf.gather(dy, inds, axis=1)                                   # B x k
    dx = tf.matmul(dy_k, _take_columns(w, inds), transpose_b=True)       # B x n
    dw = _place_columns(tf.matmul(x, dy_k, transpose_a=True), inds, m)   # n x m
    return dx, dw


def per_example_backward(x, w, dy, k):
    """(dx, dW) of the per-example mode: each row of ``dy`` keeps its own top k.

    The kept entries differ from row to row, so they do not form a dense block that
    a matmul could use; TensorFlow's sparse-dense matmul was slower on CPU than the
    dense product at the densities meProp uses (k/m of 1% to 20%). The sparsified
    ``dy_k`` is therefore multiplied densely: this mode reproduces the paper's
    gradient exactly, but costs O(B n m) here, like a dense layer (plus the top-k).
    Use ``"unified"`` for speed.
    """
    idx = tf.math.top_k(_scores(dy), k, sorted=False).indices           # B x k
    rows = tf.broadcast_to(tf.range(tf.shape(dy)[0])[:, None], tf.shape(idx))
    where = tf.stack([rows, idx], axis=-1)                               # B x k x 2
    dy_k = tf.scatter_nd(where, tf.gather_nd(dy, where), tf.shape(dy))
    dx = tf.matmul(dy_k, w, transpose_b=True)
    dw = tf.matmul(x, dy_k, transpose_a=True)
    return dx, dw


_BACKWARD = {"unified": unified_backward, "per_example": per_example_backward}


def meprop_matmul(x, w, k, mode="unified"):
    """``x @ w`` whose gradient keeps only k of the m output coordinates.

    Args:
      x: B x n tensor.
      w: n x m tensor with a static last dimension (a kernel).
      k: how many output coordinates the backward pass keeps, 1 <= k <= m. With
        k == m nothing is dropped and the ordinary matmul gradient is used (as the
        authors' code does), so the result is exactly a dense layer's.
      mode: ``"unified"`` (one index set per batch) or ``"per_example"`` (one per
        row); see the module docstring.

    Returns:
      The B x m product; its gradients with respect to ``x`` and ``w`` are the
      sparsified ones.
    """
    k = _check_int("k", k)
    backward = _BACKWARD[_check_mode(mode)]
    m = w.shape[-1]
    if m is None:
        raise ValueError("meprop_matmul needs the last dimension of `w` to be known")
    if k > m:
        raise ValueError(f"`k` ({k}) must not exceed the number of output units ({m})")
    if k == m:
        return tf.matmul(x, w)

    @tf.custom_gradient
    def _linear(x, w):
        def grad(dy):
            return backward(x, w, dy, k)
        return tf.matmul(x, w), grad

    return _linear(x, w)


# ------------------------------------------------------------------------ layer


@keras.saving.register_keras_serializable(package="tfgc")
class MePropDense(keras.layers.Layer):
    """A dense layer trained with meProp: the backward pass keeps the top-k gradients.

    ``MePropDense(units, k)`` computes what ``keras.layers.Dense(units)`` computes,
    ``activation(x W + b)``, with the same weights (``kernel`` is input_dim x units,
    ``bias`` is units; ``set_weights(dense.get_weights())`` works both ways). Only the
    gradient differs: of the gradient ``dy`` with respect to the pre-activation
    output ``x W + b`` (as in the paper, the activation is applied after the
    sparsified linear part), k of the ``units`` coordinates are used for the input
    gradient ``dx`` and the kernel gradient ``dW``:

    * ``mode="unified"`` (default): the k columns with the largest ``sum |dy|`` over
      the batch, shared by every example. ``dW`` is zero outside those columns.
      Costs O(B n k) multiply-adds instead of O(B n m); the zero-filled ``dW``
      (n x m) is still written every step, as the optimizer expects a dense one.
      As in the authors' PyTorch code, the optimizer sees that dense gradient, so
      one with momentum (Adam) still moves the unselected columns a little.
    * ``mode="per_example"``: each example keeps its own k largest ``|dy|``. Exact
      to the paper's definition, but computed with dense matmuls on the sparsified
      ``dy`` (the authors' GPU code has this path too, next to a sparse-matmul one;
      TensorFlow's sparse-dense product was slower than the dense one at these
      densities), so it brings no speed-up: use it to study the method.

    Choices, following the authors' code (lancopku/meProp, ``src/pytorch/functions.py``)
    rather than the paper's equations where they differ:

    * the bias gradient is the FULL ``sum_b dy``, not the sparsified one (the code
      sums the whole ``dy`` for ``db``);
    * ``k == units`` disables the selection and gives exactly Dense's gradients;
    * inputs of rank > 2 are accepted, like Dense: the leading dimensions are
      flattened into one batch of rows, so in unified mode the index set is shared by
      all positions of all examples, and in per-example mode each position
      (row) keeps its own k.

    Where the reference figures come from: the authors report (paper, and the table
    in the README of lancopku/meProp; MLP with 500-d hidden layers, Adam, timed on
    CPU with their C# implementation, which selects per example) for MNIST with
    k = 80 a total back-propagation time of 29 s against 170 s for dense (5.9x) and
    test accuracy 98.27% against 98.20%. Those are the authors' numbers, not ours:
    the speed-up here depends on the hardware, the layer width and the mode, and
    ``benchmarks/meprop.py`` measures it against ``keras.layers.Dense``.

    Implementation: the sparsified linear part is a ``tf.custom_gradient`` over the
    matmul (:func:`meprop_matmul`); the bias is added outside it, so TensorFlow's
    own gradient of ``bias_add`` gives the full ``db``. In the unified mode, reading
    the k columns of W and writing the k columns of dW are compiled with XLA (see
    ``_take_columns`` and ``_place_columns``); the rest is plain TensorFlow.

    Args:
      units: output dimension m, >= 1.
      k: output coordinates kept in the backward pass, 1 <= k <= units.
      mode: ``"unified"`` or ``"per_example"``.
      activation: as for Dense (applied after the sparsified linear part).
      use_bias: whether to add a bias.
      kernel_initializer, bias_initializer: as for Dense.
      **kwargs: standard layer arguments (``name``, ``dtype``, ``trainable``...).
    """

    def __init__(self, units, k, mode="unified", activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.units = _check_int("units", units)
        self.k = _check_int("k", k)
        if self.k > self.units:
            raise ValueError(f"`k` ({self.k}) must not exceed `units` ({self.units}): "
                             f"meProp keeps k of the units' gradients")
        self.mode = _check_mode(mode)
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.input_spec = keras.layers.InputSpec(min_ndim=2)
        self.supports_masking = True

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        last_dim = tf.compat.dimension_value(input_shape[-1])
        if last_dim is None:
            raise ValueError("The last dimension of the inputs to MePropDense should be "
                             f"defined; got input shape {input_shape}")
        self.input_spec = keras.layers.InputSpec(min_ndim=2, axes={-1: last_dim})
        self.kernel = self.add_weight("kernel", shape=[last_dim, self.units],
                                      initializer=self.kernel_initializer,
                                      dtype=self.dtype, trainable=True)
        if self.use_bias:
            self.bias = self.add_weight("bias", shape=[self.units],
                                        initializer=self.bias_initializer,
                                        dtype=self.dtype, trainable=True)
        else:
            self.bias = None
        self.built = True

    def call(self, inputs):
        inputs = tf.convert_to_tensor(inputs)
        if inputs.dtype != self.compute_dtype:
            inputs = tf.cast(inputs, self.compute_dtype)
        # Reading the kernel as a tensor (cast to the compute dtype under mixed
        # precision) lets the custom gradient treat it like any other input.
        kernel = tf.convert_to_tensor(self.kernel)
        rank = inputs.shape.rank
        if rank == 2:
            outputs = meprop_matmul(inputs, kernel, self.k, self.mode)
        else:
            # Flatten the leading dimensions into rows, as Dense's tensordot does.
            n = int(kernel.shape[0])
            rows = meprop_matmul(tf.reshape(inputs, [-1, n]), kernel, self.k, self.mode)
            outputs = tf.reshape(rows, tf.concat([tf.shape(inputs)[:-1], [self.units]], 0))
            if not tf.executing_eagerly():
                outputs.set_shape(inputs.shape[:-1].concatenate([self.units]))
        if self.use_bias:
            outputs = tf.nn.bias_add(outputs, self.bias)
        if self.activation is not None:
            outputs = self.activation(outputs)
        return outputs

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if input_shape.rank is not None and input_shape.rank < 2:
            raise ValueError(f"MePropDense needs inputs of rank >= 2, got {input_shape}")
        return input_shape[:-1].concatenate(self.units)

    def get_config(self):
        config = super().get_config()
        config.update({
            "units": self.units,
            "k": self.k,
            "mode": self.mode,
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        })
        return config
