"""Tensor fusion: which allreduces share one MPI call, and the buffers they use."""

import math

import numpy as np

from mpitrain import dtypes
from mpitrain.ops import OpType


def allreduce_nbytes(response):
    return math.prod(response.shape) * dtypes.BY_CODE[response.dtype].reduce_as.itemsize


def plan(responses, threshold):
    """Split a round's responses into groups executed together.

    Allreduces that reduce in the same dtype with the same op and scale
    factors share a group until it would exceed ``threshold`` bytes; every
    other response runs alone. The plan depends only on the responses, which
    are identical on every rank, so every rank fuses identically.
    """
    groups = []
    open_groups = {}
    for response in responses:
        if response.kind != OpType.ALLREDUCE:
            groups.append([response])
            continue
        nbytes = allreduce_nbytes(response)
        key = (dtypes.BY_CODE[response.dtype].reduce_as, response.op,
               response.prescale, response.postscale)
        current = open_groups.get(key)
        if current is None or current[1] + nbytes > threshold:
            current = open_groups[key] = [[response], nbytes]
            groups.append(current[0])
        else:
            current[0].append(response)
            current[1] += nbytes
    return groups


class FusionBuffers:
    """Persistent buffers, one per dtype, that only grow."""

    def __init__(self):
        self._buffers = {}

    def get(self, dtype, count):
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.size < count:
            buffer = self._buffers[dtype] = np.empty(count, dtype=dtype)
        return buffer[:count]
