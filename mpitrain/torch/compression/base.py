"""Compressors that own their communication, for payloads MPI cannot sum.

A Horovod compressor (casts.py) turns a gradient into a smaller tensor that
is still summed by an allreduce. A top-k payload (values and indices), sign
bits or 8/4-bit codes with their scales cannot be summed as they are, and
PowerSGD needs two allreduces with work between them; so such a compressor
submits its own collectives through mpitrain's public ops and hands back an
exchange to wait on.
"""

import torch

from mpitrain.api.compression import CompressorSettings, check_gathered_shapes, padded_shape
from mpitrain.torch.ops import grouped_allgather_async


class GradientCompressor(CompressorSettings):
    """Compresses gradients and moves them between ranks itself.

    ``compress(tensor, name)`` gives (payload, context), a tuple of tensors
    that travels and what rebuilds the tensor; ``decompress(payload,
    context)`` gives this rank's approximation of the tensor back.
    ``start(tensor, name, process_set)`` exchanges it with every rank of the
    set and returns an exchange whose ``wait()`` gives the sum over ranks of
    their approximations, after which ``exchange.mine`` is this rank's.

    Parameters with fewer than ``min_elements`` elements or fewer than two
    dimensions (biases, norms) travel uncompressed unless chosen explicitly
    (see DistributedOptimizer's ``compression``).
    """

    def applies_to(self, p):
        """Is ``p`` compressed when this compressor is chosen for the whole model?"""
        return self.takes_shape(p.shape)

    def compress(self, tensor, name=None):
        raise NotImplementedError

    def decompress(self, payload, context):
        raise NotImplementedError

    def start(self, tensor, name, process_set):
        """Gather every rank's payload; each rank decompresses them all and sums.

        Allgather rather than allreduce: codes with a scale of their own on
        each rank (or values at different indices) have no meaningful sum
        on the wire. Each rank receives size - 1 payloads, which for the
        payloads here (1/4 to 1/32 of the tensor) is less than an allreduce
        of the tensor moves on a few ranks, growing with the ranks.
        """
        payload, context = self.compress(tensor, name)
        # The shape travels too: allgather takes payloads of any length, so a
        # rank whose tensor differs would otherwise be sliced wrongly, silently.
        shape = torch.tensor(padded_shape(tensor.shape), device=tensor.device)
        sent = list(payload) + [shape]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in sent)
        handle = grouped_allgather_async(sent, f"{name}.{type(self).__name__}",
                                         process_set)
        return GatheredExchange(self, handle, payload, context, name, process_set.size())


class GatheredExchange:
    """Every rank's payload, gathered; ``wait()`` sums their decompressions."""

    __slots__ = ("_compressor", "_handle", "_payload", "_context", "_name", "_size", "mine")

    def __init__(self, compressor, handle, payload, context, name, size):
        self._compressor = compressor
        self._handle = handle
        self._payload = payload
        self._context = context
        self._name = name
        self._size = size
        self.mine = None

    def wait(self):
        *gathered, shapes = self._handle.wait()
        check_gathered_shapes(shapes.view(self._size, -1).tolist(), self._name)
        # Every rank's payload has the same shapes (the tensors' match), so
        # rank i's part of each concatenation is its i-th equal slice.
        parts = [t.view(self._size, -1) for t in gathered]
        total = None
        for rank in range(self._size):
            value = self._compressor.decompress(tuple(p[rank] for p in parts),
                                                self._context)
            total = value if total is None else total.add_(value)
        self.mine = self._compressor.decompress(self._payload, self._context)
        return total
