"""Tensor fusion: which allreduces share one MPI call, and the buffers they use."""

import math

from mpitrain.backends import dtypes
from mpitrain.engine.execution.streaming import streams
from mpitrain.ops import OpType


# Copying into and out of the fusion buffer costs more than a separate MPI
# call from about this size up (measured with Open MPI over shared memory).
ALONE_BYTES = 512 * 1024


def _fusion_of(response):
    """(what must match to share a buffer, bytes in the buffer), computed once."""
    if not response.fusion:
        wire = dtypes.wire(dtypes.BY_CODE[response.dtype], response.op, response.prescale,
                           response.postscale)
        response.fusion = ((wire, response.op, response.prescale, response.postscale,
                            response.device),
                           math.prod(response.shape) * wire.itemsize)
    return response.fusion


class Group:
    """Responses executed together, with the layout of their fusion buffer."""

    __slots__ = ("responses", "names", "counts", "starts", "total", "nbytes",
                 "_views", "_views_of")

    def __init__(self, response, nbytes=0):
        self.responses = [response]
        self.names = [response.name]
        self.counts = [math.prod(response.shape)]
        self.starts = [0]                 # where each response begins in the buffer
        self.total = self.counts[0]
        self.nbytes = nbytes
        self._views = None
        self._views_of = None

    def views(self, buffer):
        """One view of ``buffer`` per response, shaped like it.

        Steady-state plans are reused, and so are their views, while the
        fusion buffer stays the same.
        """
        if self._views_of is not buffer:
            self._views = [buffer[start:start + count].reshape(response.shape)
                           for response, start, count
                           in zip(self.responses, self.starts, self.counts)]
            self._views_of = buffer
        return self._views

    def add(self, response, nbytes):
        self.responses.append(response)
        self.names.append(response.name)
        count = math.prod(response.shape)
        self.counts.append(count)
        self.starts.append(self.total)
        self.total += count
        self.nbytes += nbytes


def plan(responses, threshold, streams_from=None):
    """Split a round's responses into groups executed together.

    Allreduces that reduce in the same dtype with the same op and scale
    factors share a group until it would exceed ``threshold`` bytes; an
    allreduce of ALONE_BYTES or more, which needs no conversion, is reduced
    in its own memory; every other response runs alone. Where the set
    streams groups of ``streams_from`` bytes or more through shared memory
    (without the fusion buffer's copies, mpitrain.engine.execution.streaming), large
    allreduces that can stream join groups that reach that size. The plan
    depends only on the responses and the set's route, which are identical
    on every rank, so every rank fuses identically.
    """
    groups = []
    open_groups = {}
    for response in responses:
        if response.kind != OpType.ALLREDUCE:
            groups.append(Group(response))
            continue
        key, nbytes = _fusion_of(response)
        if _alone(response, nbytes, key) and not (
                streams_from is not None and streams(response, key[0])):
            groups.append(Group(response, nbytes))
            continue
        current = open_groups.get(key)
        if current is None or current.nbytes + nbytes > threshold:
            current = open_groups[key] = Group(response, nbytes)
            groups.append(current)
        else:
            current.add(response, nbytes)
    if streams_from is None:
        return groups
    return [part for group in groups for part in _unless_streamed(group, streams_from)]


def _alone(response, nbytes, key):
    """Is the allreduce large enough, and free of conversion, to skip fusion?"""
    return nbytes >= ALONE_BYTES and key[0] == dtypes.BY_CODE[response.dtype].numpy


def _unless_streamed(group, streams_from):
    """A group too small to stream, without the allreduces that would have
    gone alone: those run alone again, before the rest."""
    if group.nbytes >= streams_from or len(group.responses) == 1:
        return [group]
    alone, rest = [], None
    for response in group.responses:
        key, nbytes = _fusion_of(response)
        if _alone(response, nbytes, key):
            alone.append(Group(response, nbytes))
        elif rest is None:
            rest = Group(response, nbytes)
        else:
            rest.add(response, nbytes)
    return alone + ([rest] if rest is not None else [])


class FusionBuffers:
    """Persistent buffers, one per device and dtype, that only grow."""

    def __init__(self):
        self._buffers = {}

    def get(self, dtype, count, backend):
        """A 1-D buffer of at least ``count`` elements where ``backend`` keeps arrays."""
        key = (backend.device, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.size < count:
            buffer = self._buffers[key] = backend.empty((count,), dtype)
        return buffer
