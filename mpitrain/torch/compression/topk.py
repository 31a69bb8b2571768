"""Top-k sparsification: the k entries largest in magnitude, as values and indices."""

import torch

from mpitrain.api.compression import TopKSettings
from mpitrain.torch.compression.base import GradientCompressor


class TopK(TopKSettings, GradientCompressor):
    """Keeps a fraction (a float in (0, 1]) or a count (an int) of the entries."""

    def compress(self, tensor, name=None):
        flat = tensor.reshape(-1)
        indices = flat.abs().topk(self.count(flat.numel()), sorted=False).indices
        index_dtype = torch.int32 if flat.numel() < 2 ** 31 else torch.int64
        return (flat[indices], indices.to(index_dtype)), (tensor.shape, tensor.dtype)

    def decompress(self, payload, context):
        values, indices = payload
        shape, dtype = context
        flat = torch.zeros(shape.numel(), dtype=dtype, device=values.device)
        return flat.index_put_((indices.long(),), values).view(shape)
