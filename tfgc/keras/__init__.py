"""Keras integration: compression statistics, learning-rate schedules and layers.

* :class:`CompressionStatsCallback` puts a compressed strategy's communication
  figures into Keras logs and the progress bar.
* :class:`AutoPlanCallback` keeps ``compressor="auto"``'s plan fitted to the link
  and to the critical regimes of training.
* :class:`LinearScalingWarmup` is Goyal et al.'s linear learning-rate scaling with
  gradual warm-up, as a learning-rate schedule.
* :class:`MePropDense` is a dense layer trained with meProp (Sun et al. 2017): its
  backward pass keeps only the top-k output gradients, which sparsifies compute
  rather than communication.
* :class:`MomentDense` is a dense layer whose kernel gradient comes with the second
  moment of its per-sample gradients, for variance-based compression.
"""

from tfgc.keras.callbacks import AutoPlanCallback, CompressionStatsCallback
from tfgc.keras.meprop import MePropDense
from tfgc.keras.moments import MomentDense
from tfgc.keras.schedules import LinearScalingWarmup, scaled_learning_rate

__all__ = ["AutoPlanCallback", "CompressionStatsCallback", "LinearScalingWarmup", "MePropDense", "MomentDense",
           "scaled_learning_rate"]
