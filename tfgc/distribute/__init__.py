"""The strategy, its cross-device ops, the gradient context and the compression state store."""

from tfgc.distribute.gradients import compress_gradients
from tfgc.distribute.state import CompressionState, get_state

__all__ = ["CompressionState", "compress_gradients", "get_state"]
