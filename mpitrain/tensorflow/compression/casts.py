"""Horovod's compressors: cast floating-point tensors to 16 bits for the wire."""

import tensorflow as tf


class Compressor:
    """compress(tensor) -> (tensor, context); decompress(tensor, context) -> tensor."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, context):
        return tensor


class NoneCompressor(Compressor):
    """Sends tensors as they are."""


def _cast_compressor(wire_dtype):
    class CastCompressor(Compressor):
        @staticmethod
        def compress(tensor):
            if not tensor.dtype.is_floating or tensor.dtype == wire_dtype:
                return tensor, None
            return tf.cast(tensor, wire_dtype), tensor.dtype

        @staticmethod
        def decompress(tensor, context):
            return tensor if context is None else tf.cast(tensor, context)
    return CastCompressor


class FP16Compressor(_cast_compressor(tf.float16)):
    """Sends floating-point tensors as float16 (mpitrain reduces them in float32)."""


class BF16Compressor(_cast_compressor(tf.bfloat16)):
    """Sends floating-point tensors as bfloat16: float32's range, 8 bits of mantissa."""

