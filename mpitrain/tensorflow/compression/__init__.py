"""Gradient compression for TensorFlow: Horovod's casts, and compressors with
their own communication (the numpy counterparts of mpitrain.torch's; see
docs/compression.md)."""

from mpitrain.api.compression import CompressionFactories
from mpitrain.tensorflow.compression.casts import (BF16Compressor, Compressor,
                                                   FP16Compressor, NoneCompressor)
from mpitrain.tensorflow.compression.error_feedback import ErrorFeedback
from mpitrain.tensorflow.compression.gathered import (GradientCompressor, OneBit, Quantize,
                                                      TopK)
from mpitrain.tensorflow.compression.powersgd import PowerSGD


class Compression(CompressionFactories):
    """The compressors, as Horovod names them (none, fp16, bf16), and mpitrain's."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    error_feedback = ErrorFeedback
    topk_class = TopK
    onebit_class = OneBit
    quantize_class = Quantize
    powersgd_class = PowerSGD


__all__ = ["BF16Compressor", "Compression", "Compressor", "ErrorFeedback",
           "FP16Compressor", "GradientCompressor", "NoneCompressor", "OneBit",
           "PowerSGD", "Quantize", "TopK"]
