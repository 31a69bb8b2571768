"""1-bit compression: each entry's sign, and a scale per chunk (1-bit SGD/Adam)."""

import torch

from mpitrain.api.compression import OneBitSettings
from mpitrain.torch.compression.base import GradientCompressor
from mpitrain.torch.compression.packing import chunked, pack_bits, per_element, unpack_bits


class OneBit(OneBitSettings, GradientCompressor):
    """Sends sign bits and, per chunk, the mean magnitude (float32).

    sign(x) * mean|x| is the closest multiple of sign(x) to x in the least
    squares sense; what it loses is large, so use it with error feedback.
    ``chunk_size=None`` gives one scale per tensor.
    """

    def compress(self, tensor, name=None):
        flat = tensor.reshape(-1)
        size = self.chunk_size or flat.numel()
        rows = chunked(flat.abs().float(), size)
        # The last chunk's padding is not part of its mean.
        counts = torch.full((rows.shape[0],), size, dtype=torch.float32,
                            device=flat.device)
        counts[-1] = flat.numel() - size * (rows.shape[0] - 1)
        scales = rows.sum(1) / counts
        return (pack_bits(flat >= 0), scales), (tensor.shape, tensor.dtype, size)

    def decompress(self, payload, context):
        bits, scales = payload
        shape, dtype, size = context
        count = shape.numel()
        signs = unpack_bits(bits, count).to(torch.float32) * 2 - 1
        return (signs * per_element(scales, size, count)).to(dtype).view(shape)
