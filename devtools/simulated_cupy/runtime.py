"""cupy.cuda.runtime: the device count and bus ids, memory, and memcpyAsync."""

import ctypes

from devtools.simulated_cupy import simulation
from devtools.simulated_cupy.errors import CUDARuntimeError, runtime_error
from devtools.simulated_cupy.memory import DEVICE, EXTERNAL, PINNED, host_view
from devtools.simulated_cupy.streams import current_device, stream_of

__all__ = ["CUDARuntimeError", "getDeviceCount", "getDevice", "setDevice",
           "deviceGetPCIBusId", "memGetInfo", "malloc", "free", "memcpyAsync"]

memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice, \
    memcpyDefault = range(5)
_SIDES = {memcpyHostToHost: ((PINNED,), (PINNED,)),
          memcpyHostToDevice: ((DEVICE, EXTERNAL), (PINNED,)),
          memcpyDeviceToHost: ((PINNED,), (DEVICE, EXTERNAL)),
          memcpyDeviceToDevice: ((DEVICE, EXTERNAL), (DEVICE, EXTERNAL)),
          memcpyDefault: ((DEVICE, EXTERNAL, PINNED), (DEVICE, EXTERNAL, PINNED))}


def getDeviceCount():
    return simulation.state().device_count


def getDevice():
    return current_device()


def setDevice(device):
    from devtools.simulated_cupy.streams import Device
    Device(device).use()


def deviceGetPCIBusId(device):
    return simulation.state().bus_id(device)


def memGetInfo():
    """(free, total) bytes of the current device."""
    pool = simulation.state().pool(current_device())
    return pool.capacity - pool.used, pool.capacity


def malloc(size):
    return simulation.state().pool(current_device()).malloc(size)


def free(ptr):
    simulation.state().pool(current_device()).free(ptr)


def memcpyAsync(dst, src, size, kind, stream):
    """Queue a copy of ``size`` bytes on the stream whose handle is ``stream``.

    Host memory must be pinned (alloc_pinned_memory): an asynchronous copy
    from pageable memory would be a synchronous one on a GPU, and code that
    counts on it overlapping is wrong.
    """
    if kind not in _SIDES:
        raise runtime_error(21, f"kind {kind}")
    if size == 0:
        return
    state = simulation.state()
    to_kinds, from_kinds = _SIDES[kind]
    registry = state.registry

    def copy():
        target = host_view(registry, dst, (size,), (1,), "u1", to_kinds,
                           "memcpyAsync's destination")
        source = host_view(registry, src, (size,), (1,), "u1", from_kinds,
                           "memcpyAsync's source")
        ctypes.memmove(target.ctypes.data, source.ctypes.data, size)

    with state.scheduler.lock:       # refused at the call too, as CUDA's API refuses
        for address, kinds, side in ((dst, to_kinds, "destination"),
                                     (src, from_kinds, "source")):
            host_view(registry, address, (size,), (1,), "u1", kinds,
                      f"memcpyAsync's {side}")
    state.scheduler.enqueue(stream_of(stream)._queue, f"memcpyAsync of {size} bytes",
                            copy, [(dst, size), (src, size)])
