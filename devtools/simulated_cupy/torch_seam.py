"""CPU tensors through mpitrain's torch adapter as simulated device arrays.

torch on this machine has no CUDA tensors, so the tests' torch code runs on
CPU tensors, and this seam makes mpitrain's torch adapter treat them as CUDA
tensors: where the adapter would take a CUDA tensor into CuPy through DLPack
(mpitrain.torch.tensors._shared), it gets a simulated device array over the
tensor's storage, and where it would hand a CuPy result back through DLPack
(_tensor), a CPU tensor over the array's memory. Everything between is
mpitrain's GPU path on the simulated device.

torch's own operations on those tensors run at once on the CPU: what torch
queues on its streams on a GPU, and DLPack's stream handshake, are not
simulated. ``host_tensors()`` turns the seam off for a block, for a
reference computed on the host.
"""

import contextlib

import numpy as np

from devtools.simulated_cupy import memory, simulation
from devtools.simulated_cupy.memory import MemoryPointer
from devtools.simulated_cupy.ndarray import ndarray
from devtools.simulated_cupy.streams import current_device

_on = [False]
_originals = {}


def enable():
    """From now on, CPU tensors reach mpitrain's core as simulated device arrays."""
    from mpitrain.torch import tensors
    if not _originals:
        _originals.update(shared=tensors._shared, tensor=tensors._tensor)
        tensors._shared = _shared
        tensors._tensor = _tensor
    _on[0] = True


def enabled():
    return _on[0]


@contextlib.contextmanager
def host_tensors():
    """CPU tensors are host tensors again inside the block."""
    was, _on[0] = _on[0], False
    try:
        yield
    finally:
        _on[0] = was


def _shared(tensor, device):
    if device == "cpu" and _on[0]:
        return device_array(tensor)
    return _originals["shared"](tensor, device)


def _tensor(array):
    if isinstance(array, ndarray):
        return host_tensor(array)
    return _originals["tensor"](array)


def device_array(tensor):
    """A simulated device array over ``tensor``'s memory, its layout kept; it
    keeps the tensor alive."""
    state = simulation.state()
    dtype = tensor.numpy().dtype
    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    if size == 0:
        owner = memory.Memory(0, 0, current_device())
        offset = 0
    else:
        owner = memory.external(state.registry, state.scheduler, start, size,
                                current_device(), tensor)
        offset = tensor.data_ptr() - start
    strides = tuple(stride * dtype.itemsize for stride in tensor.stride())
    return ndarray(tuple(tensor.shape), dtype, MemoryPointer(owner, offset), strides)


class _Exposed:
    """numpy's view of a simulated array's memory, keeping the array alive."""

    def __init__(self, array):
        self.array = array
        self.__array_interface__ = {
            "shape": array.shape, "typestr": array.dtype.str, "version": 3,
            "data": (array.data.ptr, False), "strides": array.strides}


def host_tensor(array):
    """A CPU tensor over a simulated array's memory (what torch.from_dlpack
    gives on a GPU); it keeps the array alive."""
    import torch
    if array.size == 0:
        return torch.from_numpy(np.empty(array.shape, array.dtype))
    return torch.from_numpy(np.asarray(_Exposed(array)))
