"""Host buffers handed out again once nothing refers to them any more.

Fresh multi-MiB memory costs a page fault per page the first time it is
written: for a 64 MiB result, several milliseconds, a sixth of the
allreduce itself. Results of the same sizes come back step after step, so
a buffer is kept once its result has been dropped and serves the next
result of its size. Every array made from a buffer, and every tensor
adopting one, holds a reference to it, so a buffer is reused only after
the last of them has gone: results stay valid for as long as they are held.

A model has many tensors of one size (ResNet-50's 3x3 convolutions of a
stage, BERT's 48 matrices of 768 x 768), all held by the caller until the
next step; so as many buffers of a size are kept as a step holds at once,
and the search for an idle one starts where the last one was found, since
a step drops its results together. Small buffers come from malloc's heap,
which reuses them without page faults: only MIN_BYTES and more are kept.
When the sizes change (another model, evaluation), the idle buffers of the
sizes least recently asked for make room for the new ones.
"""

import math
import sys

import numpy as np

from mpitrain.backends.host import ALIGNMENT, aligned_bytes, empty

MIN_BYTES = 64 << 10


class RecycledBuffers:
    """Aligned 1-D uint8 buffers, at most ``per_size`` kept per byte count and
    ``most_bytes`` kept in all (beyond that, buffers are simply allocated)."""

    def __init__(self, per_size=256, most_bytes=1 << 30):
        self.per_size = per_size
        self.most_bytes = most_bytes
        self.kept_bytes = 0
        # byte count -> owners of the memory; in the order the sizes were last
        # asked for, the least recent first
        self._kept = {}
        self._next = {}              # byte count -> where the search for an idle one starts

    def take(self, nbytes):
        """A buffer of ``nbytes`` bytes starting on a 64-byte boundary."""
        if nbytes < MIN_BYTES:
            return empty((nbytes,), np.uint8)
        kept = self._kept.pop(nbytes, [])
        self._kept[nbytes] = kept                # now the most recent size
        count = len(kept)
        start = self._next.get(nbytes, 0)
        for step in range(count):
            at = (start + step) % count
            if sys.getrefcount(kept[at]) == _IDLE:
                self._next[nbytes] = at + 1
                return aligned_bytes(kept[at], nbytes)
        owner = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
        if count < self.per_size and self._room_for(nbytes):
            kept.append(owner)
            self.kept_bytes += nbytes
        return aligned_bytes(owner, nbytes)

    def _room_for(self, nbytes):
        """Whether a buffer of nbytes more fits, after letting go of idle
        buffers of the sizes least recently asked for."""
        if self.kept_bytes + nbytes <= self.most_bytes:
            return True
        for size in list(self._kept):
            if size == nbytes:           # the most recent: every older size was tried
                break
            kept = self._kept[size]
            for at in range(len(kept) - 1, -1, -1):
                if sys.getrefcount(kept[at]) == _IDLE:
                    del kept[at]
                    self.kept_bytes -= size
            if self.kept_bytes + nbytes <= self.most_bytes:
                return True
        return False

    def empty(self, shape, dtype):
        """An uninitialized C-contiguous array, like mpitrain.backends.host.empty."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES:
            return empty(shape, dtype)   # at once: a step may ask for hundreds
        return self.take(nbytes).view(dtype).reshape(shape)


def _idle_references():
    """What getrefcount reports in take()'s loop for an owner nothing else holds."""
    kept = [np.empty(0, dtype=np.uint8)]
    return sys.getrefcount(kept[0])


_IDLE = _idle_references()
