"""Gradient compressors: one algorithm per module, built by name through the registry."""

from tfgc.compressors.auto import Auto
from tfgc.compressors.base import CompressContext, Compressor
from tfgc.compressors.casts import BF16, FP16, Identity
from tfgc.compressors.dgc import DGC
from tfgc.compressors.error_feedback import ErrorFeedback
from tfgc.compressors.fft import FFT
from tfgc.compressors.gradiveq import GradiVeQ
from tfgc.compressors.powersgd import PowerSGD
from tfgc.compressors.quantizers import QSGD, OneBit, ScaledSign, SignSGD, TernGrad
from tfgc.compressors.recommended import Recommendation, recommended, recommended_settings
from tfgc.compressors.registry import (describe, get, names, register, serialize,
                                       serialize_config)
from tfgc.compressors.sparse import Importance, RandomK, TopK
from tfgc.compressors.thresholds import Adaptive, GradientDropping, Threshold
from tfgc.compressors.variance import Variance

__all__ = [
    "Adaptive", "Auto", "BF16", "CompressContext", "Compressor", "DGC", "describe", "ErrorFeedback", "FFT", "FP16",
    "GradiVeQ", "GradientDropping", "Identity", "Importance", "OneBit",
    "PowerSGD", "QSGD", "RandomK", "Recommendation", "recommended", "recommended_settings", "ScaledSign", "SignSGD", "TernGrad", "Threshold", "TopK", "Variance", "get", "names", "register",
    "serialize", "serialize_config",
]
