"""A fused group's tensors streamed through a host reducer chunk by chunk.

Packing a group into the fusion buffer, reducing the buffer and unpacking it
again passes over the whole group five times. Through shared memory each
chunk's inputs can instead go straight into the segment and its results
straight out of it into the outputs (SharedMemoryAllreduce's fill and
drain), while the chunk is still in cache: the fusion buffer then serves
only as scratch space.
"""

import bisect

from mpitrain.backends import dtypes
from mpitrain.backends.host import scale_into
from mpitrain.ops import ReduceOp
from mpitrain.transport.chunk_io import ChunkIO


def streams(response, wire):
    """Can fused allreduces like ``response``, reduced as ``wire``, stream?
    Host memory only; not Adasum, which combines each tensor on its own, nor
    integer sums and averages, which are scaled once the whole sum is in."""
    return (response.device < 0 and response.op != ReduceOp.ADASUM
            and not dtypes.exact(wire, response.op))


class Stream(ChunkIO):
    """The chunks of tensors laid out at ``starts``, filled from their inputs
    and drained into their outputs (a ChunkIO).

    sources: the flat inputs (None for a joined rank's share, which adds
    zeros), times prescale on the way in; outputs: the flat outputs (None
    where this rank has no tensor), times factor on the way out; wire: the
    numpy dtype reduced.
    """

    fills = drains = True

    def __init__(self, starts, counts, sources, outputs, prescale, factor, wire):
        self.starts = starts
        self.ends = [start + count for start, count in zip(starts, counts)]
        self.sources = sources
        self.outputs = outputs
        self.prescale = prescale
        self.factor = factor
        self.wire = wire

    def _pieces(self, start, stop):
        """(tensor, its first element, how many) of the buffer's elements start:stop."""
        tensor = bisect.bisect_right(self.starts, start) - 1
        while tensor < len(self.starts) and self.starts[tensor] < stop:
            low = max(start, self.starts[tensor])
            high = min(stop, self.ends[tensor])
            if low < high:
                yield tensor, low - self.starts[tensor], high - low
            tensor += 1

    def fill(self, start, stop, destination):
        at = 0
        for tensor, first, count in self._pieces(start, stop):
            into = destination[at:at + count]
            source = self.sources[tensor]
            if source is None:
                into[...] = 0
            else:
                scale_into(source[first:first + count], self.prescale, into)
            at += count

    def read(self, start, stop):
        """The inputs of elements start:stop where they lie, as (offset from
        start, array) pieces; None where one must first be scaled or
        converted, or is a joined rank's zeros."""
        if self.prescale != 1.0:
            return None
        pieces, at = [], 0
        for tensor, first, count in self._pieces(start, stop):
            source = self.sources[tensor]
            if source is None or source.dtype != self.wire:
                return None
            pieces.append((at, source[first:first + count]))
            at += count
        return pieces

    def drain(self, start, stop, source):
        at = 0
        for tensor, first, count in self._pieces(start, stop):
            output = self.outputs[tensor]
            if output is not None:
                scale_into(source[at:at + count], self.factor,
                           output[first:first + count])
            at += count


def flat(array):
    """A 1-D view of a contiguous array (None stays None)."""
    if array is None or array.ndim == 1:
        return array
    return array.reshape(-1)        # the method: a fifth of numpy.reshape's time
