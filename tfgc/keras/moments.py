"""``MomentDense``: a Dense layer that also yields the second moment of its per-sample
kernel gradients, for variance-based compression (Tsuzuku, Imachi & Akiba 2018).

For y = x W on a minibatch of B rows, Keras's mean loss gives the upstream gradient
dy whose row z is (1/B) dL_z/dy_z, and the kernel gradient x^T dy is the mean of the
per-sample gradients g_z = x_z (B dy_z)^T. The sum of their squares follows from the
same two tensors with one more matmul of the kernel gradient's size:

    (1/B^2) sum_z g_z^2 = (x * x)^T (dy * dy)

which is the estimate of the variance of the minibatch-mean gradient that the
compressor compares the accumulated gradient with (the paper's "negligible
additional cost"; its exact formulation could not be read here, and this is the
standard identity for per-sample squared gradients of a dense layer). It costs one
extra matmul in the backward pass, about a third of the layer's backward work.

The layer hands that moment over as the gradient of a *moment probe*, a variable
shaped like the kernel that the forward pass ignores (``tfgc.distribute.moments``).
The compressed strategy pairs it with the kernel's gradient and sends nothing for
it; under any other strategy it is all-reduced like a gradient and the optimizer
applies it to the probe, which changes nothing the model computes.
"""

import tensorflow as tf
import tf_keras as keras

from tfgc.distribute import moments


@tf.custom_gradient
def _matmul_with_moment(x, kernel, probe):
    del probe  # read for its gradient only

    def grad(dy):
        dx = tf.matmul(dy, kernel, transpose_b=True)
        dkernel = tf.matmul(x, dy, transpose_a=True)
        moment = tf.matmul(tf.square(x), tf.square(dy), transpose_a=True)
        return dx, dkernel, moment

    return tf.matmul(x, kernel), grad


@keras.saving.register_keras_serializable(package="tfgc")
class MomentDense(keras.layers.Dense):
    """``keras.layers.Dense`` whose kernel gradient comes with its per-sample second
    moment, for ``"variance"`` compression. Same arguments and forward pass as Dense;
    inputs of rank > 2 are flattened to rows over their leading axes, as Dense's
    tensordot does.
    """

    def build(self, input_shape):
        super().build(input_shape)
        self.kernel_moment = self.add_weight(
            "kernel_moment", shape=self.kernel.shape, initializer="zeros",
            dtype=self.dtype, trainable=True)
        moments.register_probe(self.kernel_moment, self.kernel)

    def call(self, inputs):
        inputs = tf.cast(inputs, self.compute_dtype)
        rows = tf.reshape(inputs, [-1, tf.shape(inputs)[-1]])
        kernel = tf.cast(self.kernel, self.compute_dtype)
        probe = tf.cast(self.kernel_moment, self.compute_dtype)
        out = _matmul_with_moment(rows, kernel, probe)
        out = tf.reshape(out, tf.concat([tf.shape(inputs)[:-1], [self.units]], 0))
        if self.use_bias:
            out = tf.nn.bias_add(out, tf.cast(self.bias, self.compute_dtype))
        if self.activation is not None:
            out = self.activation(out)
        return out
