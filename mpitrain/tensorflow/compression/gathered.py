"""Top-k, 1-bit and 8/4-bit compressors on numpy arrays, for TensorFlow gradients.

The same payloads and sums as mpitrain.torch's (see
mpitrain/torch/compression/base.py): every rank's payload is allgathered
through the numpy core, and each rank decompresses them all and sums in
rank order, so every rank holds the same result.
"""

import numpy as np

from mpitrain.api import array_ops
from mpitrain.api.compression import (CompressorSettings, OneBitSettings, QuantizeSettings,
                                      TopKSettings, check_gathered_shapes, padded_shape)
from mpitrain.api.handles import synchronize


class GradientCompressor(CompressorSettings):
    """compress(array, name) -> (payload, context); decompress(payload, context);
    exchange(array, name, process_set) -> (sum over ranks, this rank's part);
    state(name) / load_state(name, state, own): numpy arrays for checkpoints."""

    def applies_to(self, shape):
        """Is a gradient of ``shape`` compressed when chosen for the whole model?"""
        return self.takes_shape(shape)

    def exchange(self, array, name, process_set):
        payload, context = self.compress(array, name)
        # The shape travels too (see mpitrain/torch/compression/base.py).
        sent = list(payload) + [np.array(padded_shape(array.shape), np.int64)]
        self.bytes_sent += sum(part.nbytes for part in sent)
        *gathered, shapes = synchronize(array_ops.grouped_allgather_async(
            sent, f"{name}.{type(self).__name__}", process_set))
        size = process_set.size()
        check_gathered_shapes(shapes.reshape(size, -1).tolist(), name)
        parts = [part.reshape(size, -1) for part in gathered]
        total = sum(self.decompress(tuple(part[rank] for part in parts), context)
                    for rank in range(size))
        return total, self.decompress(payload, context)


class TopK(TopKSettings, GradientCompressor):
    """The entries largest in magnitude: a fraction (float) or a count (int)."""

    def compress(self, array, name=None):
        flat = array.reshape(-1)
        k = self.count(flat.size)
        indices = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]
        return (flat[indices], indices.astype(np.int32)), (array.shape, array.dtype)

    def decompress(self, payload, context):
        values, indices = payload
        shape, dtype = context
        flat = np.zeros(int(np.prod(shape)), dtype)
        flat[indices] = values
        return flat.reshape(shape)


def _chunked(flat, chunk_size):
    return np.pad(flat, (0, -flat.size % chunk_size)).reshape(-1, chunk_size)


class OneBit(OneBitSettings, GradientCompressor):
    """Sign bits and the mean magnitude of each chunk (None: of the tensor)."""

    def compress(self, array, name=None):
        flat = array.reshape(-1)
        size = self.chunk_size or flat.size
        rows = _chunked(np.abs(flat).astype(np.float32), size)
        counts = np.full(rows.shape[0], size, np.float32)
        counts[-1] = flat.size - size * (rows.shape[0] - 1)
        return ((np.packbits(flat >= 0), rows.sum(1) / counts),
                (array.shape, array.dtype, size))

    def decompress(self, payload, context):
        bits, scales = payload
        shape, dtype, size = context
        count = int(np.prod(shape))
        signs = np.unpackbits(bits, count=count).astype(np.float32) * 2 - 1
        return (signs * np.repeat(scales, size)[:count]).astype(dtype).reshape(shape)


class Quantize(QuantizeSettings, GradientCompressor):
    """Codes of 8 bits (-127..127) or 4 bits (-7..7, two to a byte), a scale per chunk."""

    def compress(self, array, name=None):
        flat = array.reshape(-1)
        rows = _chunked(flat.astype(np.float32), self.chunk_size)
        scales = np.abs(rows).max(1) / self.levels
        codes = np.round(rows / np.where(scales > 0, scales, 1)[:, None])
        codes = codes.reshape(-1)[:flat.size]
        if self.bits == 8:
            packed = codes.astype(np.int8)
        else:
            nibbles = np.pad((codes + 8).astype(np.uint8), (0, flat.size % 2))
            packed = (nibbles[0::2] << 4) | nibbles[1::2]
        return (packed, scales), (array.shape, array.dtype)

    def decompress(self, payload, context):
        packed, scales = payload
        shape, dtype = context
        count = int(np.prod(shape))
        if self.bits == 8:
            codes = packed.astype(np.float32)
        else:
            codes = np.stack((packed >> 4, packed & 15), 1).reshape(-1)[:count]
            codes = codes.astype(np.float32) - 8
        scale = np.repeat(scales, self.chunk_size)[:count]
        return (codes * scale).astype(dtype).reshape(shape)
