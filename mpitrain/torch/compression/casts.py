"""Horovod's compressors: cast floating tensors to 16 bits for the wire.

The core reduces 16-bit floats in float32 and rounds once, so compression
halves the bytes moved without accumulating rounding error across ranks.
"""

import torch


class Compressor:
    """Turns a tensor into what travels, and the result back."""

    @staticmethod
    def compress(tensor):
        """Return (tensor to send, context for decompress)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def _caster(wire_dtype):
    class CastCompressor(Compressor):
        @staticmethod
        def compress(tensor):
            if tensor.dtype.is_floating_point and tensor.dtype != wire_dtype:
                return tensor.to(wire_dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tensor.to(ctx)

    return CastCompressor


class FP16Compressor(_caster(torch.float16)):
    """Sends floating tensors as float16 (range up to 65504)."""


class BF16Compressor(_caster(torch.bfloat16)):
    """Sends floating tensors as bfloat16 (float32's range, 8 bits of mantissa)."""

