"""The CuPy backend: fusion buffers, packing and scaling on a CUDA device.

Not run on the development machines (they have no GPU): see docs/gpu.md for
what was and was not run. Every call works on the engine's own stream of the
device, after the streams that produced the inputs (recorded at submission).
"""

import contextlib
import math

import numpy as np

_CTYPES = {np.dtype(t): c for t, c in [
    (np.uint8, "unsigned char"), (np.int8, "signed char"), (np.uint16, "unsigned short"),
    (np.int16, "short"), (np.int32, "int"), (np.int64, "long long"),
    (np.float16, "__half"), (np.float32, "float"), (np.float64, "double")]}

_UNPACK = r"""
#include <cuda_fp16.h>
extern "C" __global__ void mpitrain_unpack(
        const {source}* buffer, const unsigned long long* outputs,
        const long long* output_starts, const long long* buffer_starts,
        const int count, const double factor, const long long total) {{
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {{
        int low = 0, high = count - 1;          // the output that element i belongs to
        while (low < high) {{
            int middle = (low + high + 1) >> 1;
            if (output_starts[middle] <= i) low = middle; else high = middle - 1;
        }}
        long long j = i - output_starts[low];
        {target}* out = reinterpret_cast<{target}*>(outputs[low]);
        out[j] = {value};
    }}
}}
"""


def _load(ctype, expression):
    return f"__half2float({expression})" if ctype == "__half" else expression


def _store(ctype, expression):
    if ctype == "__half":
        return f"__float2half((float)({expression}))"
    return f"({ctype})({expression})"


class Device:
    """Arrays on one CUDA device, worked on by the engine's stream there."""

    def __init__(self, cupy, ordinal):
        self.cupy = cupy
        self.device = ordinal
        with cupy.cuda.Device(ordinal):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._kernels = {}
        self._pinned = {}

    @contextlib.contextmanager
    def active(self):
        with self.cupy.cuda.Device(self.device), self.stream:
            yield

    def empty(self, shape, dtype):
        with self.active():
            return self.cupy.empty(shape, dtype)

    def zeros(self, count, dtype):
        with self.active():
            return self.cupy.zeros(count, dtype)

    def scale_into(self, source, factor, out):
        with self.active():
            if factor == 1.0:
                self.cupy.copyto(out, source, casting="unsafe")
            else:
                self.cupy.multiply(source, factor, out=out, casting="unsafe")

    def pack(self, sources, out, factor):
        """One concatenation kernel for all sources, then the scaling."""
        with self.active():
            self.cupy.concatenate([s.ravel() for s in sources], out=out,
                                  casting="unsafe")
            if factor != 1.0:
                self.cupy.multiply(out, factor, out=out, casting="unsafe")

    def unpack(self, buffer, offsets, views, outputs, factor):
        """Scatter a reduced buffer into the outputs with one kernel launch.

        views[i] starts at element offsets[i] of the 1-D buffer and goes to
        outputs[i]; regions of the buffer without an output are skipped.
        """
        if not outputs:
            return
        if not all(o.flags.c_contiguous and o.dtype == outputs[0].dtype for o in outputs):
            for view, output in zip(views, outputs):
                self.scale_into(view, factor, output)
            return
        counts = [math.prod(v.shape) for v in views]
        total = sum(counts)
        if total == 0:
            return
        kernel = self._unpack_kernel(buffer.dtype, outputs[0].dtype, factor != 1.0)
        with self.active():
            pointers = self.cupy.asarray([o.data.ptr for o in outputs], dtype=np.uint64)
            output_starts = self.cupy.asarray(np.cumsum([0] + counts[:-1]), dtype=np.int64)
            buffer_starts = self.cupy.asarray(offsets, dtype=np.int64)
            threads = 256
            blocks = min(4096, -(-total // threads))
            kernel((blocks,), (threads,),
                   (buffer, pointers, output_starts, buffer_starts,
                    np.int32(len(outputs)), np.float64(factor), np.int64(total)))

    def _unpack_kernel(self, source, target, scaled):
        key = (source, target, scaled)
        if key not in self._kernels:
            value = _load(_CTYPES[source], "buffer[buffer_starts[low] + j]")
            if scaled:
                value = f"(double)({value}) * factor"
            code = _UNPACK.format(source=_CTYPES[source], target=_CTYPES[target],
                                  value=_store(_CTYPES[target], value))
            self._kernels[key] = self.cupy.RawKernel(code, "mpitrain_unpack")
        return self._kernels[key]

    def record_ready(self):
        """On the submitting thread: an event after everything queued so far."""
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(self.cupy.cuda.get_current_stream())
        return event

    def wait_for_inputs(self, handles):
        """Order the engine's stream after the streams that produced the inputs."""
        for handle in handles:
            if handle is not None and handle.ready is not None:
                self.stream.wait_event(handle.ready)

    def settle(self):
        """Wait until the engine's work on this device has finished."""
        self.stream.synchronize()

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

    def to_host(self, array, host):
        with self.active():
            array.get(out=host, stream=self.stream)
        self.settle()

    def from_host(self, host, array):
        with self.active():
            array.set(host, stream=self.stream)

    def to_numpy(self, array):
        with self.active():
            host = self.cupy.asnumpy(array, stream=self.stream)
        self.settle()
        return host

    def from_numpy(self, host, into=None):
        with self.active():
            if into is None:
                into = self.cupy.asarray(host)
            else:
                into.set(np.ascontiguousarray(host), stream=self.stream)
        self.settle()
        return into
