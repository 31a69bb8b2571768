"""Gradient compression: Horovod's casts, and compressors with their own communication.

``Compression.none / fp16 / bf16`` cast each gradient for the fused
allreduce, as in Horovod, and a user's class with static ``compress`` and
``decompress`` works the same way. ``topk``, ``onebit``, ``int8``, ``int4``
and ``powersgd`` move their payloads themselves (see base.py); all but
``topk(..., error_feedback=False)`` and the like keep error feedback.
See docs/compression.md.
"""

from mpitrain.api.compression import CompressionFactories
from mpitrain.torch.compression.base import GradientCompressor
from mpitrain.torch.compression.casts import (BF16Compressor, Compressor, FP16Compressor,
                                              NoneCompressor)
from mpitrain.torch.compression.error_feedback import ErrorFeedback
from mpitrain.torch.compression.powersgd import PowerSGD
from mpitrain.torch.compression.quantize import Quantize
from mpitrain.torch.compression.sign import OneBit
from mpitrain.torch.compression.topk import TopK


class Compression(CompressionFactories):
    """The compressors to pass as ``compression=``."""

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
