"""Allreduce on device buffers through NCCL.

MPI still carries the negotiation and NCCL's unique id; the data moves over
NCCL on the engine's stream. Dtypes NCCL lacks (16-bit integers) keep using
MPI.
"""

import numpy as np

from mpitrain.ops import ReduceOp

# NCCL's types, by the names of cupy.cuda.nccl's constants
_TYPE_NAMES = {np.dtype(t): name for t, name in [
    (np.uint8, "NCCL_UINT8"), (np.int8, "NCCL_INT8"), (np.int32, "NCCL_INT32"),
    (np.int64, "NCCL_INT64"), (np.float16, "NCCL_FLOAT16"), (np.float32, "NCCL_FLOAT32"),
    (np.float64, "NCCL_FLOAT64")]}
DTYPES = frozenset(_TYPE_NAMES)


def _module():
    from cupy.cuda import nccl    # a submodule that `import cupy` does not load
    return nccl


def unique_id():
    return _module().get_unique_id()


class NcclAllreduce:
    """One NCCL communicator of a process set, bound to one device."""

    def __init__(self, unique_id, rank, size, device):
        nccl = _module()
        self.device = device
        self._comm = nccl.NcclCommunicator(size, unique_id, rank)
        self._types = {dtype: getattr(nccl, name) for dtype, name in _TYPE_NAMES.items()}
        self._ops = {ReduceOp.AVERAGE: nccl.NCCL_SUM, ReduceOp.SUM: nccl.NCCL_SUM,
                     ReduceOp.MIN: nccl.NCCL_MIN, ReduceOp.MAX: nccl.NCCL_MAX,
                     ReduceOp.PRODUCT: nccl.NCCL_PROD}

    def allreduce(self, buffer, op, stream):
        """Reduce a contiguous device buffer in place, queued on ``stream``."""
        pointer = buffer.data.ptr
        self._comm.allReduce(pointer, pointer, buffer.size, self._types[buffer.dtype],
                             self._ops[op], stream.ptr)
