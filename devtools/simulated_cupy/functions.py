"""cupy's functions that mpitrain and its tests call: making arrays, copies
between host and device and on the device, and the memory pool."""

import numpy as np

from devtools.simulated_cupy import simulation
from devtools.simulated_cupy.ndarray import NO_ARITHMETIC, Layout, elementwise, enqueue, \
    ndarray
from devtools.simulated_cupy.streams import current_device, current_stream


def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype)


def empty_like(prototype, dtype=None):
    return ndarray(prototype.shape, prototype.dtype if dtype is None else dtype)


def full(shape, fill_value, dtype=None):
    array = ndarray(shape, np.array(fill_value).dtype if dtype is None else dtype)
    array.fill(fill_value)
    return array


def zeros(shape, dtype=float):
    return full(shape, 0, dtype)


def ones(shape, dtype=float):
    return full(shape, 1, dtype)


def zeros_like(a, dtype=None):
    return full(a.shape, 0, a.dtype if dtype is None else dtype)


def full_like(a, fill_value, dtype=None):
    return full(a.shape, fill_value, a.dtype if dtype is None else dtype)


def arange(start, stop=None, step=1, dtype=None):
    values = np.arange(start, stop, step, dtype)     # the values only, to size it
    array = ndarray(values.shape, values.dtype)
    target = Layout(array)

    def run():
        target.view("arange")[...] = np.arange(start, stop, step, dtype)
    enqueue("arange", run, [array])
    return array


def copyto(dst, src, casting="same_kind", where=None):
    """Copy ``src`` (a device array or a scalar) into ``dst``, broadcast and cast."""
    if where is not None:
        raise NotImplementedError("copyto(where=...) on the simulated device")
    if isinstance(src, ndarray):
        if src.dtype != dst.dtype and not np.can_cast(src.dtype, dst.dtype, casting):
            raise TypeError(f"Cannot cast array data from {src.dtype!r} to "
                            f"{dst.dtype!r} according to the rule '{casting}'")
        if np.broadcast_shapes(src.shape, dst.shape) != dst.shape:
            raise ValueError(f"could not broadcast from shape {src.shape} into {dst.shape}")
        if src.dtype != dst.dtype and {src.dtype, dst.dtype} & set(NO_ARITHMETIC):
            raise TypeError(f"a cast between {src.dtype} and {dst.dtype}: CuPy need not "
                            "do arithmetic on bfloat16; copy it by its bits")
        source, target = Layout(src), Layout(dst)
        label = "copy" if src.dtype == dst.dtype else f"cast to {dst.dtype}"

        def run():
            with np.errstate(all="ignore"):
                np.copyto(target.view(label), source.view(label), casting="unsafe")
        enqueue(label, run, [src, dst])
        return
    if not np.isscalar(src) and not (isinstance(src, np.ndarray) and src.ndim == 0):
        raise TypeError(f"copyto: src must be a device array or a scalar, not "
                        f"{type(src).__name__} (host arrays go through cupy.asarray)")
    value, target = np.asarray(src).item(), Layout(dst)

    def fill():
        with np.errstate(all="ignore"):
            target.view("fill")[...] = value
    enqueue("fill", fill, [dst])


def ascontiguousarray(a, dtype=None):
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    result = ndarray(a.shape, a.dtype if dtype is None else dtype)
    copyto(result, a, casting="unsafe")
    return result


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    """``a`` on the current device: a device array as it is, host data copied.
    The copy takes the host values at the call, as a copy from pageable memory does."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.array(a, dtype=dtype, order="C", copy=True)
    array = ndarray(host.shape, host.dtype)
    target = Layout(array)

    def upload():
        target.view("copy to the device")[...] = host
    enqueue(f"copy of {host.nbytes} bytes to the device", upload, [array])
    return array



def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """A host copy of ``a``, queued on ``stream`` (the current one); with
    ``blocking``, after that stream has run up to it."""
    if not isinstance(a, ndarray):
        return np.asarray(a, order=order)
    host = np.empty(a.shape, a.dtype) if out is None else out
    source = Layout(a)
    stream = current_stream() if stream is None else stream

    def download():
        host[...] = source.view("copy to the host")
    enqueue(f"copy of {a.nbytes} bytes to the host", download, [a], stream)
    if blocking:
        stream.synchronize()
    return host


def trunc(x, /, out=None):
    return elementwise(np.trunc, x, out=out)


class _MemoryPool:
    """cupy.get_default_memory_pool(): the current device's pool."""

    def _pool(self):
        return simulation.state().pool(current_device())

    def free_all_blocks(self, stream=None):
        self._pool().free_all_blocks()

    def used_bytes(self):
        return self._pool().used_bytes()

    def total_bytes(self):
        return self._pool().total_bytes()


_DEFAULT_POOL = _MemoryPool()


def get_default_memory_pool():
    return _DEFAULT_POOL
