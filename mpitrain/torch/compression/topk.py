"""Top-k sparsification: the k entries largest in magnitude, as values and indices."""

import torch

from mpitrain.torch.compression.base import DEFAULT_MIN_ELEMENTS, GradientCompressor


class TopK(GradientCompressor):
    """Keeps a fraction (a float in (0, 1]) or a count (an int) of the entries."""

    def __init__(self, amount, min_elements=DEFAULT_MIN_ELEMENTS):
        super().__init__(min_elements)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) \
                or not (0 < amount <= 1 if isinstance(amount, float) else amount >= 1):
            raise ValueError("topk takes a fraction in (0, 1] (a float) or a count >= 1 "
                             f"(an int), got {amount!r}")
        self.amount = amount

    def count(self, numel):
        if isinstance(self.amount, float):
            return max(1, min(numel, round(self.amount * numel)))
        return min(numel, self.amount)

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

    def __repr__(self):
        return f"Compression.topk({self.amount!r})"
