"""The CuPy backend: fusion buffers, packing, scaling and copies on one CUDA device.

Every call works on the engine's own stream of the device, ordered after the
streams that produced the inputs (an event recorded at submission).
"""

import collections
import contextlib
import itertools

import numpy as np

from mpitrain.backends import kernels
from mpitrain.backends.host import divide_toward_zero

_TABLES_KEPT = 128                 # segment tables cached on the device
_sequence = itertools.count()      # orders readiness events across streams


class Device:
    """Arrays on one CUDA device, worked on by the engine's stream there."""

    def __init__(self, cupy, ordinal):
        self.cupy = cupy
        self.device = ordinal
        with cupy.cuda.Device(ordinal):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.bus_id = cupy.cuda.runtime.deviceGetPCIBusId(ordinal)
        self._modules = {}             # wire dtype -> compiled pack/unpack kernels
        self._tables = collections.OrderedDict()    # table bytes -> device copy
        self._pinned = {}              # dtype -> (page-locked memory, bytes)

    @contextlib.contextmanager
    def active(self):
        with self.cupy.cuda.Device(self.device), self.stream:
            yield

    def empty(self, shape, dtype):
        with self.active():
            return self.cupy.empty(shape, dtype)

    # -- kernels ---------------------------------------------------------------

    def kernels(self, wire):
        """The pack and unpack kernels for buffers of ``wire``, compiled on first use."""
        wire = np.dtype(wire)
        found = self._modules.get(wire)
        if found is None:
            with self.cupy.cuda.Device(self.device):
                module = self.cupy.RawModule(code=kernels.source(wire),
                                             options=("--std=c++14",))
                module.compile()
                found = (module.get_function("mpitrain_pack"),
                         module.get_function("mpitrain_unpack"))
            self._modules[wire] = found
        return found

    def _launch(self, kernel, buffer, segments, total, factor):
        if total == 0:
            return
        table = self._table(kernels.table(segments))
        grid, block = kernels.launch_shape(total)
        kernel(grid, block, (buffer, table, np.int32(len(segments)), np.int64(total),
                             np.float64(factor), np.int32(factor != 1.0)))

    def _table(self, host):
        """The segment table on the device; steady-state steps reuse their tables."""
        key = host.tobytes()
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self.cupy.asarray(host)
            if len(self._tables) > _TABLES_KEPT:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return table

    def pack(self, sources, counts, out, factor):
        """Copy sources one after another into the 1-D ``out``, times factor.

        A source of None (a joined rank's share) contributes ``count`` zeros.
        A strided source is read from a contiguous copy, held until the kernel
        is queued: dropped sooner, CuPy's pool hands its memory to the next
        copy or to the segment table, which the stream writes before the
        kernel reads it (channels_last gradients came out as garbage so).
        """
        with self.active():
            segments, held, start = [], [], 0
            for source, count in zip(sources, counts):
                if source is None:
                    segments.append((0, start, start, kernels.SAME))
                else:
                    readable = self._contiguous(source)
                    held.append(readable)
                    segments.append((readable.data.ptr, start, start,
                                     kernels.code(readable.dtype)))
                start += count
            self._launch(self.kernels(out.dtype)[0], out, segments, start, factor)

    def unpack(self, buffer, offsets, views, outputs, factor):
        """Scatter views of a reduced buffer into the outputs, times factor.

        views[i] starts at element offsets[i] of the 1-D buffer. One launch
        fills every output; a strided output gets a contiguous stand-in first.
        """
        with self.active():
            segments, start, strided = [], 0, []
            for offset, output in zip(offsets, outputs):
                target = output
                if not output.flags.c_contiguous:
                    target = self.cupy.empty(output.shape, output.dtype)
                    strided.append((target, output))
                segments.append((target.data.ptr, start, offset, kernels.code(output.dtype)))
                start += output.size
            self._launch(self.kernels(buffer.dtype)[1], buffer, segments, start, factor)
            for target, output in strided:
                self.cupy.copyto(_bits(output), _bits(target))

    def scale_into(self, source, factor, out):
        """out = source * factor, for arrays of one wire type (the type dtypes.wire gives)."""
        with self.active():
            if out.flags.c_contiguous:
                self.pack([source], [source.size], out.reshape(-1), factor)
            elif factor == 1.0:
                self.cupy.copyto(out, source)
            else:
                scaled = self.cupy.empty(out.shape, out.dtype)
                self.pack([source], [source.size], scaled.reshape(-1), factor)
                self.cupy.copyto(out, scaled)

    def scale_integers(self, values, scale, divisor):
        """values = values * scale / divisor in place, truncated toward zero:
        exact where scale is 1; otherwise in float64, exact below 2**53."""
        with self.active():
            if scale == 1.0:
                quotient = divide_toward_zero(values, divisor)
            else:
                quotient = self.cupy.trunc(values.astype(np.float64) * scale / divisor)
            values[...] = quotient

    def _contiguous(self, array):
        """``array`` or a C-contiguous copy, copied by its bits (CuPy may lack bfloat16 math)."""
        if array.flags.c_contiguous:
            return array
        return self.cupy.ascontiguousarray(_bits(array)).view(array.dtype)

    # -- ordering against the producers and the host ---------------------------

    def record_ready(self):
        """On the submitting thread: (stream, order, event) after everything queued so far."""
        with self.cupy.cuda.Device(self.device):
            stream = self.cupy.cuda.get_current_stream()
            event = self.cupy.cuda.Event(disable_timing=True)
            event.record(stream)
        return stream.ptr, next(_sequence), event

    def wait_for_inputs(self, handles):
        """Order the engine's stream after the streams that produced the inputs.

        An event recorded later on a stream covers the earlier ones: one wait
        per stream is enough, however many tensors came from it.
        """
        latest = {}
        for handle in handles:
            if handle is not None and handle.ready is not None:
                stream, order, event = handle.ready
                if stream not in latest or latest[stream][0] < order:
                    latest[stream] = (order, event)
        for _, event in latest.values():
            self.stream.wait_event(event)

    def settle(self):
        """Wait until the engine's work on this device has finished."""
        self.stream.synchronize()

    # -- host memory -------------------------------------------------------------

    def pinned(self, dtype, count):
        """A grow-only page-locked host buffer, for staging through the host."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        memory, capacity = self._pinned.get(dtype, (None, 0))
        if memory is None or capacity < nbytes:
            capacity = max(nbytes, 1)
            memory = self.cupy.cuda.alloc_pinned_memory(capacity)
            self._pinned[dtype] = (memory, capacity)
        return np.frombuffer(memory, dtype, count)

    def download(self, array, host):
        """Queue a copy of contiguous ``array`` into pinned ``host``; returns its end event.

        The event blocks a waiting thread instead of spinning it.
        """
        with self.active():
            self._copy(host.ctypes.data, array.data.ptr, array.nbytes)
            done = self.cupy.cuda.Event(block=True, disable_timing=True)
            done.record(self.stream)
        return done

    def upload(self, host, array):
        """Queue a copy of pinned ``host`` into contiguous ``array``."""
        with self.active():
            self._copy(array.data.ptr, host.ctypes.data, array.nbytes)

    def _copy(self, destination, source, nbytes):
        if nbytes:
            runtime = self.cupy.cuda.runtime
            runtime.memcpyAsync(destination, source, nbytes, runtime.memcpyDefault,
                                self.stream.ptr)

    def to_numpy(self, array):
        with self.active():
            host = self.cupy.asnumpy(_bits(array), stream=self.stream)
        self.settle()
        return host.view(array.dtype)

    def from_numpy(self, host, into=None):
        """``host`` on this device: in ``into`` where given, else in a new array."""
        host = np.ascontiguousarray(host)
        with self.active():
            array = self.cupy.asarray(_bits(host)).view(host.dtype)
            if into is not None:
                self.cupy.copyto(_bits(into), _bits(array))
                array = into
        self.settle()
        return array


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(array):
    """A view of ``array`` as unsigned integers of its width: copies need no float type."""
    return array.view(_UNSIGNED[array.dtype.itemsize])
