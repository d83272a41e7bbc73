"""The randomized block Hadamard rotation that rotated quantizers apply first.

A vector is cut into blocks of ``block`` elements (a power of two); block ``x_b`` of
``m`` elements becomes ``H_m (s * x_b) / sqrt(m)``, with ``s`` a vector of random
signs shared by every worker and ``H_m`` the Sylvester Hadamard matrix (entries +-1,
``H_m H_m = m I``). The map is orthogonal: it keeps norms and sums, so the workers
may add rotated vectors and rotate the sum back once, and the rotation with the
signs left out (``H_m / sqrt(m)``) is its own inverse.

Why: after the rotation every coordinate of a block is a sum of its elements with
random signs, ``y_i = sum_j H_ij s_j x_j / sqrt(m)``, sub-Gaussian with variance
proxy ``||x_b||^2 / m`` (Hoeffding), whatever ``x_b`` was. A block's largest
coordinate, which scales a max-normed quantizer's levels, is then of the order of
``||x_b|| sqrt(2 ln(m) / m)`` instead of up to ``||x_b||``: one spike no longer costs
the whole block its resolution. This is the rotation of Suresh, Yu, Kumar & McMahan
(ICML 2017, stochastic rotated quantization) and of THC (Li et al., NSDI 2024), here
per block so that its cost is ``log2(block)`` butterflies per element and a chunk of
whole blocks (the reduce-scatter's) rotates as the whole vector would.

Lengths. A vector of ``n`` elements is padded with zeros to ``padded_length(n,
block)``: whole blocks, and a last block of the next power of two at or above what
is left (``n % block``), so that every block is a power of two and the padding is
less than the remainder.

``block_hadamard`` runs the compiled kernel when the op library is loaded and
``block_hadamard_reference`` otherwise; both apply the same butterflies in the same
order and agree bit for bit. With a CUDA-enabled TensorFlow the op also has a GPU
kernel (``custom_ops/cc/kernels/rotation_gpu.cu.cc``), with the same bits again: it
checks the signs on the device (one synchronisation) and runs at the speed of a copy
for blocks up to 4096 elements (``benchmarks/results/cuda_kernels_h100.md``).
"""

import numpy as np
import tensorflow as tf

from tfgc.ops import _loader
from tfgc.ops._validation import invalid

MAX_BLOCK = 1 << 20

try:
    tf.no_gradient("TfgcBlockHadamard")
except KeyError:  # already registered, e.g. on module reload
    pass


def is_power_of_two(m: int) -> bool:
    return m >= 1 and m & (m - 1) == 0


def check_block(block) -> int:
    """``block`` as an int; InvalidArgumentError unless a power of two up to 2^20."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) \
            or not is_power_of_two(int(block)) or block > MAX_BLOCK:
        invalid(f"block must be a power of two from 1 to {MAX_BLOCK}, got {block!r}")
    return int(block)


def padded_length(n: int, block: int) -> int:
    """Elements of a rotated vector of ``n``: whole blocks, and the remainder rounded up
    to a power of two."""
    tail = n % block
    if tail:
        tail = 1 << (tail - 1).bit_length()
    return n - n % block + tail


def random_signs(seed, block: int) -> tf.Tensor:
    """``block`` float32 signs, +1 or -1 with equal probability, drawn from ``seed``
    (an int64 ``[2]`` stateless seed): the same seed gives the same signs everywhere."""
    u = tf.random.stateless_uniform([check_block(block)], seed=seed)
    return tf.where(u < 0.5, tf.constant(-1.0), tf.constant(1.0))


def _static_length(x) -> int:
    n = x.shape.num_elements()
    if n is None:
        invalid(f"x must have a static number of elements, got shape {x.shape}")
    return n


def _check_vector(x, signs, block):
    x = tf.convert_to_tensor(x)
    signs = tf.convert_to_tensor(signs)
    if x.dtype != tf.float32 or signs.dtype != tf.float32:
        raise TypeError(f"x and signs must be float32, got {x.dtype.name} and {signs.dtype.name}")
    if x.shape.rank is not None and x.shape.rank != 1:
        invalid(f"x must be a vector, got shape {x.shape}")
    if signs.shape.rank is not None and (signs.shape.rank != 1 or
                                         signs.shape[0] not in (None, block)):
        invalid(f"signs must be a vector of block = {block} entries, got shape {signs.shape}")
    return x, signs


def block_hadamard_reference(x, signs, block: int, inverse: bool = False) -> tf.Tensor:
    """``block_hadamard`` in plain TensorFlow (static lengths only)."""
    block = check_block(block)
    x, signs = _check_vector(x, signs, block)
    n = _static_length(x)
    tail = n % block
    if tail and not is_power_of_two(tail):
        invalid(f"the last block of x must have a power-of-two length: {n} elements in "
                f"blocks of {block} leave {tail}")
    tf.debugging.assert_equal(tf.abs(signs), tf.ones_like(signs),
                              message="signs must be +1 or -1")
    parts = []
    whole = n - tail
    if whole:
        parts.append((x[:whole], block))
    if tail:
        parts.append((x[whole:], tail))
    out = []
    for part, m in parts:
        s = signs[:m]
        y = tf.reshape(part, [-1, m])
        if not inverse:
            y = y * s
        h = 1
        while h < m:
            # Groups of 2h: the pairs (j, j + h), as the kernel's passes take them.
            y = tf.reshape(y, [-1, m // (2 * h), 2, h])
            a, b = y[:, :, 0], y[:, :, 1]
            y = tf.reshape(tf.stack([a + b, a - b], 2), [-1, m])
            h *= 2
        y = y * (np.float32(1.0) / np.sqrt(np.float32(m)))
        if inverse:
            y = y * s
        out.append(tf.reshape(y, [-1]))
    if not out:
        return tf.zeros([0], tf.float32)
    return out[0] if len(out) == 1 else tf.concat(out, 0)


def block_hadamard(x, signs, block: int, inverse: bool = False) -> tf.Tensor:
    """The randomized block Hadamard rotation of the float32 vector ``x`` (or, with
    ``inverse``, its inverse). Every block, the last one included, must have a
    power-of-two length; ``signs`` holds ``block`` entries of +1 or -1.
    InvalidArgumentError otherwise."""
    block = check_block(block)
    x, signs = _check_vector(x, signs, block)
    lib = _loader.load_library()
    if lib is None:
        return block_hadamard_reference(x, signs, block, inverse)
    return lib.tfgc_block_hadamard(x, signs, block=block, inverse=inverse)


def rotate(x, signs, block: int) -> tf.Tensor:
    """``x`` flattened to float32, padded to ``padded_length`` and rotated."""
    flat = tf.reshape(tf.cast(x, tf.float32), [-1])
    n = _static_length(flat)
    pad = padded_length(n, check_block(block)) - n
    if pad:
        flat = tf.pad(flat, [[0, pad]])
    return block_hadamard(flat, signs, block)


def unrotate(y, signs, block: int, num_elements: int) -> tf.Tensor:
    """The first ``num_elements`` of the inverse rotation of ``y`` (``rotate``'s
    output, or a sum of such)."""
    return block_hadamard(y, signs, block, inverse=True)[:num_elements]
