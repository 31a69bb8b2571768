"""PowerSGD: a rank-r approximation from one power iteration, warm-started.

Vogels et al., 2019 (PyTorch DDP's powerSGD hook). The gradient as a matrix
M (first dimension by the rest): P = M Q is summed over ranks and
orthonormalized, then Q = M^T P is summed, and every rank takes P Q^T, the
sum of each rank's projection P P^T M. Q is kept for the next step (the
warm start): identical on every rank, it is part of the optimizer's state.
"""

import torch

from mpitrain.api.compression import PowerSGDSettings
from mpitrain.ops import Sum
from mpitrain.torch.compression.base import GradientCompressor
from mpitrain.torch.ops import allreduce_async


class PowerSGD(PowerSGDSettings, GradientCompressor):
    """Sends two factors of ``rank`` columns: (rows + columns) * rank numbers."""

    @staticmethod
    def copy(q):
        return q.clone()

    def _start_q(self, name, matrix):
        rows, columns = matrix.shape
        q = self.q.get(name)
        if q is None or q.shape[0] != columns:
            # Every rank draws the same Q.
            generator = torch.Generator().manual_seed(self.seed)
            q = torch.randn(columns, min(self.rank, rows, columns), generator=generator)
        return q.to(matrix.device, matrix.dtype)

    def compress(self, tensor, name=None):
        """This rank alone: P (orthonormal) and Q with M ~ P Q^T."""
        matrix = tensor.reshape(tensor.shape[0], -1)
        p = orthonormal(matrix @ self._start_q(name, matrix))
        return (p, matrix.t() @ p), tensor.shape

    def decompress(self, payload, context):
        p, q = payload
        return (p @ q.t()).view(context)

    def start(self, tensor, name, process_set):
        matrix = tensor.reshape(tensor.shape[0], -1)
        p = matrix @ self._start_q(name, matrix)
        handle = allreduce_async(p, name=f"{name}.PowerSGD.P", op=Sum,
                                 process_set=process_set)
        self.bytes_sent += p.numel() * p.element_size()
        return PowerSGDExchange(self, handle, matrix, tensor.shape, name, process_set)


class PowerSGDExchange:
    """The summed P; ``wait()`` orthonormalizes it and sums Q = M^T P."""

    __slots__ = ("_compressor", "_handle", "_matrix", "_shape", "_name",
                 "_process_set", "mine")

    def __init__(self, compressor, handle, matrix, shape, name, process_set):
        self._compressor = compressor
        self._handle = handle
        self._matrix = matrix
        self._shape = shape
        self._name = name
        self._process_set = process_set
        self.mine = None

    def wait(self):
        p = orthonormal(self._handle.wait())
        q = self._matrix.t() @ p
        self.mine = (p @ q.t()).view(self._shape)
        compressor = self._compressor
        compressor.bytes_sent += q.numel() * q.element_size()
        total_q = allreduce_async(q, name=f"{self._name}.PowerSGD.Q", op=Sum,
                                  process_set=self._process_set).wait()
        compressor.q[self._name] = total_q
        return (p @ total_q.t()).view(self._shape)


def orthonormal(matrix):
    """Orthonormal columns spanning ``matrix``'s (the same on every rank for the
    same input)."""
    return torch.linalg.qr(matrix).Q
