"""Keras integration: callbacks that report compression statistics."""

from tfgc.keras.callbacks import CompressionStatsCallback
from tfgc.keras.schedules import LinearScalingWarmup, scaled_learning_rate

__all__ = ["CompressionStatsCallback", "LinearScalingWarmup", "scaled_learning_rate"]
