"""Keras integration: callbacks that report compression statistics."""

from tfgc.keras.callbacks import CompressionStatsCallback

__all__ = ["CompressionStatsCallback"]
