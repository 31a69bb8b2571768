"""Gradient compression: Horovod's casts, and compressors with their own communication.

``Compression.none / fp16 / bf16`` cast each gradient for the fused
allreduce, as in Horovod, and a user's class with static ``compress`` and
``decompress`` works the same way. ``topk``, ``onebit``, ``int8``, ``int4``
and ``powersgd`` move their payloads themselves (see base.py); all but
``topk(..., error_feedback=False)`` and the like keep error feedback.
See docs/compression.md.
"""

from mpitrain.torch.compression.base import DEFAULT_MIN_ELEMENTS, GradientCompressor
from mpitrain.torch.compression.casts import (BF16Compressor, Compressor, FP16Compressor,
                                              NoneCompressor)
from mpitrain.torch.compression.error_feedback import ErrorFeedback
from mpitrain.torch.compression.powersgd import PowerSGD
from mpitrain.torch.compression.quantize import Quantize
from mpitrain.torch.compression.sign import OneBit
from mpitrain.torch.compression.topk import TopK


def _with_feedback(compressor, error_feedback):
    return ErrorFeedback(compressor) if error_feedback else compressor


class Compression:
    """The compressors to pass as ``compression=``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def topk(amount, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        """The largest entries: a fraction (0.01) or a count (1000) of each gradient."""
        return _with_feedback(TopK(amount, min_elements), error_feedback)

    @staticmethod
    def onebit(chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        """Signs, with a mean magnitude per chunk (None: per tensor)."""
        return _with_feedback(OneBit(chunk_size, min_elements), error_feedback)

    @staticmethod
    def int8(chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        return _with_feedback(Quantize(8, chunk_size, min_elements), error_feedback)

    @staticmethod
    def int4(chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        return _with_feedback(Quantize(4, chunk_size, min_elements), error_feedback)

    @staticmethod
    def powersgd(rank=4, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        """Two factors of ``rank`` columns, warm-started from the last step."""
        return _with_feedback(PowerSGD(rank, min_elements), error_feedback)

    error_feedback = ErrorFeedback


__all__ = ["BF16Compressor", "Compression", "Compressor", "ErrorFeedback",
           "FP16Compressor", "GradientCompressor", "NoneCompressor", "OneBit",
           "PowerSGD", "Quantize", "TopK"]
