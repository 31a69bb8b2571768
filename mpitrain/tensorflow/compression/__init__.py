"""Gradient compression for TensorFlow: Horovod's casts, and compressors with
their own communication (the numpy counterparts of mpitrain.torch's; see
docs/compression.md)."""

from mpitrain.tensorflow.compression.casts import (BF16Compressor, Compressor,
                                                   FP16Compressor, NoneCompressor)
from mpitrain.tensorflow.compression.error_feedback import ErrorFeedback
from mpitrain.tensorflow.compression.gathered import (DEFAULT_MIN_ELEMENTS,
                                                      GradientCompressor, OneBit, Quantize,
                                                      TopK)
from mpitrain.tensorflow.compression.powersgd import PowerSGD


def _with_feedback(compressor, error_feedback):
    return ErrorFeedback(compressor) if error_feedback else compressor


class Compression:
    """The compressors, as Horovod names them (none, fp16, bf16), and mpitrain's."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def topk(amount, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        return _with_feedback(TopK(amount, min_elements), error_feedback)

    @staticmethod
    def onebit(chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        return _with_feedback(OneBit(chunk_size, min_elements), error_feedback)

    @staticmethod
    def int8(chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        return _with_feedback(Quantize(8, chunk_size, min_elements), error_feedback)

    @staticmethod
    def int4(chunk_size=512, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        return _with_feedback(Quantize(4, chunk_size, min_elements), error_feedback)

    @staticmethod
    def powersgd(rank=4, error_feedback=True, min_elements=DEFAULT_MIN_ELEMENTS):
        return _with_feedback(PowerSGD(rank, min_elements), error_feedback)

    error_feedback = ErrorFeedback


__all__ = ["BF16Compressor", "Compression", "Compressor", "ErrorFeedback",
           "FP16Compressor", "GradientCompressor", "NoneCompressor", "OneBit",
           "PowerSGD", "Quantize", "TopK"]
