"""The strategy, its cross-device ops, and the per-replica compressor state."""
