"""A fused group's tensors streamed through a host reducer chunk by chunk.

Packing a group into the fusion buffer, reducing the buffer and unpacking it
again passes over the whole group five times. Through shared memory each
chunk's inputs can instead go straight into the segment and its results
straight out of it into the outputs (SharedMemoryAllreduce's fill and
drain), while the chunk is still in cache: the fusion buffer then serves
only as scratch space.
"""

import bisect

import numpy as np

from mpitrain.backends import dtypes
from mpitrain.backends.host import scale_into
from mpitrain.ops import ReduceOp
from mpitrain.transport.chunk_io import ChunkIO

# Inputs of fewer elements are packed before they are combined: one ufunc
# call each would cost more than the copy.
READ_MIN_ELEMENTS = 16384


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
    numpy dtype reduced; scratch: a 1-D buffer of the group's size, of the
    wire dtype, free for read() to pack small inputs into.
    """

    fills = drains = True

    def __init__(self, starts, counts, sources, outputs, prescale, factor, wire,
                 scratch):
        self.starts = starts
        self.ends = [start + count for start, count in zip(starts, counts)]
        self.sources = sources
        self.outputs = outputs
        self.prescale = prescale
        self.factor = factor
        self.wire = wire
        self.scratch = scratch
        # Unscaled inputs of the wire dtype, none missing: a chunk's inputs
        # are then packed in one call, and may be read where they lie.
        self.packs = prescale == 1.0 and all(
            source is not None and source.dtype == wire for source in sources)

    def _pieces(self, start, stop):
        """(tensor, its first element, how many) of the buffer's elements start:stop."""
        starts, ends = self.starts, self.ends
        first, last = self._span(start, stop)
        for tensor in range(first, last + 1):
            low = start if start > starts[tensor] else starts[tensor]
            high = stop if stop < ends[tensor] else ends[tensor]
            if low < high:
                yield tensor, low - starts[tensor], high - low

    def _span(self, start, stop):
        """The first and the last tensor holding elements of start:stop."""
        return (bisect.bisect_right(self.starts, start) - 1,
                bisect.bisect_left(self.starts, stop) - 1)

    def _inputs(self, start, stop):
        """The inputs of elements start:stop, cut to fit, in order (only where
        ``packs``)."""
        first, last = self._span(start, stop)
        parts = self.sources[first:last + 1]
        parts[-1] = parts[-1][:stop - self.starts[last]]
        parts[0] = parts[0][start - self.starts[first]:]
        return parts

    def fill(self, start, stop, destination):
        if self.packs:
            np.concatenate(self._inputs(start, stop), out=destination)
            return
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
        converted, or is a joined rank's zeros. Small inputs side by side
        are packed into the scratch buffer and read from there as one
        piece: combining each alone would cost a ufunc call apiece."""
        if not self.packs:
            return None
        pieces, small, at = [], [], 0
        for tensor, first, count in self._pieces(start, stop):
            piece = self.sources[tensor][first:first + count]
            if count < READ_MIN_ELEMENTS:
                small.append(piece)
            else:
                self._pack(small, start, at, pieces)
                pieces.append((at, piece))
            at += count
        self._pack(small, start, at, pieces)
        return pieces

    def _pack(self, small, start, end, pieces):
        """Add the small inputs that end at ``end`` (from start) to pieces:
        one as it is, several packed into the scratch buffer; empties small."""
        if len(small) == 1:
            pieces.append((end - small[0].size, small[0]))
        elif small:
            count = sum(piece.size for piece in small)
            packed = self.scratch[start + end - count:start + end]
            np.concatenate(small, out=packed)
            pieces.append((end - count, packed))
        small.clear()

    def drain(self, start, stop, source):
        outputs, factor = self.outputs, self.factor
        at = 0
        for tensor, first, count in self._pieces(start, stop):
            output = outputs[tensor]
            if output is not None:
                scale_into(source[at:at + count], factor, output[first:first + count])
            at += count


def flat(array):
    """A 1-D view of a contiguous array (None stays None)."""
    if array is None or array.ndim == 1:
        return array
    return array.reshape(-1)        # the method: a fifth of numpy.reshape's time
