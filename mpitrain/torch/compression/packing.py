"""Packing sub-byte codes into uint8, and per-chunk scales."""

import torch
import torch.nn.functional as F


def pack_bits(bits):
    """A 1-D bool tensor as uint8, eight to a byte (the first in the high bit)."""
    padded = F.pad(bits.to(torch.uint8), (0, -bits.numel() % 8))
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8,
                           device=bits.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(packed, count):
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:count].bool()


def pack_nibbles(codes):
    """A 1-D uint8 tensor of codes 0..15 as uint8, two to a byte."""
    padded = F.pad(codes, (0, codes.numel() % 2))
    return (padded[0::2] << 4) | padded[1::2]


def unpack_nibbles(packed, count):
    return torch.stack((packed >> 4, packed & 15), dim=1).view(-1)[:count]


def chunked(flat, chunk_size):
    """``flat`` padded with zeros to whole chunks, one chunk a row."""
    return F.pad(flat, (0, -flat.numel() % chunk_size)).view(-1, chunk_size)


def per_element(per_chunk, chunk_size, count):
    """A value per chunk repeated over the chunk's elements."""
    return per_chunk.repeat_interleave(chunk_size)[:count]

