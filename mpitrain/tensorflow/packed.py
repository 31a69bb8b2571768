"""Gradients reduced as one packed buffer per step, reused from step to step.

Packing (with the averaging folded in) is the only copy: the engine reduces
the packed buffer in place, and TensorFlow adopts 64-byte-aligned views of
it as the results. A buffer is reused only after TensorFlow has dropped
every result taken from it, so results stay valid for as long as they are
held, and a steady training loop allocates nothing.

One packed allreduce hides how the buffer splits into tensors, so a
fingerprint of the layout travels with it (an allreduce Max of +h and -h):
ranks whose layouts differ all find out together and raise a MismatchError
that lists each rank's shapes, instead of mixing unrelated gradients.
"""

import zlib

import numpy as np

from mpitrain.api import array_ops
from mpitrain.api.handles import synchronize
from mpitrain.api.objects import allgather_object
from mpitrain.backends.host import ALIGNMENT
from mpitrain.backends.recycled import RecycledBuffers
from mpitrain.errors import MismatchError
from mpitrain.ops import Average, Max, Sum

PACKABLE = (np.dtype(np.float32), np.dtype(np.float64))
_KEPT_PER_SIZE = 4          # buffers still held by TensorFlow when the next step starts


class _Packing:
    """Offsets of a layout's tensors in a buffer, each aligned for TensorFlow."""

    def __init__(self, layout):
        self.layout = layout
        self.dtype = np.dtype(layout[0][1])
        self.offsets = []
        end = 0
        for shape, _ in layout:
            self.offsets.append(end)
            count = int(np.prod(shape, dtype=np.int64))
            end += -(-count * self.dtype.itemsize // ALIGNMENT) * ALIGNMENT
        self.nbytes = max(end, ALIGNMENT)
        fingerprint = zlib.crc32(repr(layout).encode()) + 1
        self.fingerprint = np.array([fingerprint, -fingerprint], dtype=np.int64)

    def views(self, buffer):
        return [buffer[offset:offset + int(np.prod(shape, dtype=np.int64))
                       * self.dtype.itemsize].view(self.dtype).reshape(shape)
                for offset, (shape, _) in zip(self.offsets, self.layout)]


class PackedReducer:
    """Reduces lists of float32/float64 arrays of one dtype through packed buffers."""

    def __init__(self):
        self._packings = {}       # layout -> _Packing
        self._buffers = RecycledBuffers(per_size=_KEPT_PER_SIZE)

    def reduce(self, arrays, name, op, prescale_factor, postscale_factor, process_set):
        layout = tuple((a.shape, a.dtype.str) for a in arrays)
        packing = self._packings.get(layout)
        if packing is None:
            packing = self._packings[layout] = _Packing(layout)
        buffer = self._buffers.take(packing.nbytes)
        views = packing.views(buffer)
        # Averaging folded into the packing copy: the engine then only sums.
        scale = prescale_factor / (process_set.size() if op == Average else 1)
        for array, view in zip(arrays, views):
            if scale == 1.0:
                np.copyto(view, array)
            else:
                np.multiply(array, scale, out=view)
        flat = buffer.view(packing.dtype)
        handles = [array_ops.allreduce_async(packing.fingerprint,
                                             name=None if name is None else f"{name}.layout",
                                             op=Max, process_set=process_set),
                   array_ops.allreduce_async(flat, name=name, op=Sum if op == Average else op,
                                             postscale_factor=postscale_factor,
                                             process_set=process_set, output=flat)]
        fingerprints, data_error = synchronize(handles[0]), None
        try:
            synchronize(handles[1])
        except MismatchError as error:
            data_error = error
        if not np.array_equal(fingerprints, packing.fingerprint):
            # Every rank sees the same maxima, so all ranks come here together.
            layouts = allgather_object(
                [s for s, _ in layout], process_set=process_set,
                name=None if name is None else f"{name}.shapes")
            raise MismatchError(
                f"allreduce of gradients '{name or 'unnamed'}' failed: mismatched "
                "gradient shapes across ranks: "
                + "; ".join(f"rank {r}: {shapes}"
                            for r, shapes in zip(process_set.ranks, layouts)))
        if data_error is not None:
            raise data_error
        return views
