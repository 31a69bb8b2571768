"""Allocating result arrays."""

import math

import numpy as np

ALIGNMENT = 64   # frameworks adopt buffers aligned like this without copying them


def empty(shape, dtype):
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary.

    numpy's large allocations start 16 bytes past a page boundary, and
    TensorFlow copies any buffer it cannot adopt.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)
