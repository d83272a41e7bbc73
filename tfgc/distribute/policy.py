"""Which gradients are worth compressing."""

from typing import Optional

import tensorflow as tf


class CompressionPolicy:
    """Decides per gradient whether it is compressed or all-reduced densely.

    Biases, normalization scales and other small or 1-D tensors cost little to send
    dense and lose the most from compression (QSGD's authors leave tensors under
    10K elements unquantized); they join the plain fused all-reduce.

    Args:
      min_elements: gradients with fewer elements are sent dense. Default 1024.
      compress_vectors: also compress 1-D (and scalar) gradients that are large enough.
    """

    def __init__(self, min_elements: int = 1024, compress_vectors: bool = False):
        if isinstance(min_elements, bool) or not isinstance(min_elements, int) or min_elements < 0:
            raise ValueError(f"`min_elements` must be an integer >= 0, got {min_elements!r}")
        if not isinstance(compress_vectors, bool):
            raise ValueError(f"`compress_vectors` must be a bool, got {compress_vectors!r}")
        self.min_elements = min_elements
        self.compress_vectors = compress_vectors

    def get_config(self):
        return {"min_elements": self.min_elements, "compress_vectors": self.compress_vectors}

    def should_compress(self, tensor: tf.Tensor, compressor) -> bool:
        return self.reason(tensor, compressor) is None

    def reason(self, tensor: tf.Tensor, compressor) -> Optional[str]:
        """Why ``tensor`` goes uncompressed, one of a few fixed phrases (so gradients
        group by it), or None when it is compressed."""
        shape, dtype = tensor.shape, tensor.dtype
        if not shape.is_fully_defined():
            return "shape known only at run time"
        if not dtype.is_floating:
            return "not floating point"
        if shape.rank < 2 and not self.compress_vectors:
            return f"a {'scalar' if shape.rank == 0 else 'vector'} (compress_vectors=False)"
        if shape.num_elements() < max(self.min_elements, 1):
            return f"fewer than min_elements={self.min_elements} elements"
        if dtype.base_dtype not in compressor.dtypes:
            return f"{dtype.name}, which {compressor.name} does not take"
        if not compressor.supports(shape, dtype):
            return f"a shape {compressor.name} does not take"
        return None

    def __repr__(self):
        return f"CompressionPolicy(min_elements={self.min_elements}, compress_vectors={self.compress_vectors})"
