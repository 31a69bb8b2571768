"""8-bit and 4-bit quantization with a scale per chunk (4 bits two to a byte)."""

import torch

from mpitrain.api.compression import QuantizeSettings
from mpitrain.torch.compression.base import GradientCompressor
from mpitrain.torch.compression.packing import chunked, pack_nibbles, per_element, unpack_nibbles


class Quantize(QuantizeSettings, GradientCompressor):
    """Rounds each entry to one of 2 * levels + 1 steps of its chunk's max magnitude.

    8 bits: int8 codes in -127..127; 4 bits: -7..7, stored as 1..15 and
    packed two to a byte. Each chunk's scale (max|x| / levels) goes as float32.
    """

    def compress(self, tensor, name=None):
        flat = tensor.reshape(-1)
        rows = chunked(flat.float(), self.chunk_size)
        scales = rows.abs().amax(1) / self.levels
        # An all-zero chunk has scale 0: its codes are 0 whatever the divisor.
        codes = torch.round(rows / torch.where(scales > 0, scales, 1).unsqueeze(1))
        codes = codes.view(-1)[:flat.numel()]
        if self.bits == 8:
            packed = codes.to(torch.int8)
        else:
            packed = pack_nibbles((codes + 8).to(torch.uint8))
        return (packed, scales), (tensor.shape, tensor.dtype)

    def decompress(self, payload, context):
        packed, scales = payload
        shape, dtype = context
        count = shape.numel()
        if self.bits == 8:
            codes = packed.to(torch.float32)
        else:
            codes = unpack_nibbles(packed, count).to(torch.float32) - 8
        return (codes * per_element(scales, self.chunk_size, count)).to(dtype).view(shape)
