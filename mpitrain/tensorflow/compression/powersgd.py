"""PowerSGD on numpy arrays (see mpitrain/torch/compression/powersgd.py)."""

import numpy as np

from mpitrain.api import array_ops
from mpitrain.api.compression import PowerSGDSettings
from mpitrain.ops import Sum
from mpitrain.tensorflow.compression.gathered import GradientCompressor


class PowerSGD(PowerSGDSettings, GradientCompressor):
    """Two factors of ``rank`` columns, summed by two allreduces; Q warm-starts."""

    copy = staticmethod(np.array)

    def _start_q(self, name, matrix):
        rows, columns = matrix.shape
        q = self.q.get(name)
        if q is None or q.shape[0] != columns:
            q = np.random.default_rng(self.seed).standard_normal(
                (columns, min(self.rank, rows, columns)))
        return q.astype(matrix.dtype)

    def compress(self, array, name=None):
        matrix = array.reshape(array.shape[0], -1)
        p = np.linalg.qr(matrix @ self._start_q(name, matrix))[0]
        return (p, matrix.T @ p), array.shape

    def decompress(self, payload, context):
        p, q = payload
        return (p @ q.T).reshape(context)

    def exchange(self, array, name, process_set):
        matrix = array.reshape(array.shape[0], -1)
        p = array_ops.allreduce(matrix @ self._start_q(name, matrix),
                                name=f"{name}.PowerSGD.P", op=Sum, process_set=process_set)
        p = np.linalg.qr(p)[0]
        q = matrix.T @ p
        self.bytes_sent += p.nbytes + q.nbytes
        self.q[name] = array_ops.allreduce(q, name=f"{name}.PowerSGD.Q", op=Sum,
                                           process_set=process_set)
        return (p @ self.q[name].T).reshape(array.shape), (p @ q.T).reshape(array.shape)
