"""Torch tensors as arrays for the core, and results back as tensors.

Tensors share memory with the arrays in both directions: nothing is copied
here. One function, as_array, converts CPU and CUDA tensors alike: the same
checks, the same bfloat16 view, and arrays with the tensor's own shape,
strides and offset (``Tensor.numpy()`` and DLPack into CuPy both keep them),
so that what the CPU tests prove about layouts holds on the GPU too. torch
hands bfloat16 neither to numpy nor, through DLPack, to every CuPy, so it
travels as an int16 view that numpy or CuPy (14 and later) reinterprets as
ml_dtypes.bfloat16.
"""

import functools

import ml_dtypes
import numpy as np
import torch

from mpitrain.backends import arrays

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
SUPPORTED = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
             torch.float16, torch.bfloat16, torch.float32, torch.float64)


def as_array(tensor, what="tensor", writes=False):
    """An array sharing ``tensor``'s memory and layout; writes to it reach the tensor.

    CPU tensors become numpy arrays; CUDA tensors become CuPy arrays through
    DLPack, which orders CuPy's current stream after torch's. A tensor with
    torch's lazy negation (its negative bit) is read through a resolved copy;
    ``writes`` (an in-place result) refuses it, since the result could not
    reach it.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    device = tensor.device.type
    if device != "cpu" and (device != "cuda" or arrays.cupy() is None):
        raise TypeError(
            f"{what} is on device '{tensor.device}', but mpitrain cannot move "
            "tensors there here (mpitrain.torch.cuda_built() is False: install "
            "CuPy with `pip install mpitrain[gpu]` on a CUDA machine, or move "
            "the tensor with .cpu())")
    if tensor.layout != torch.strided:
        raise TypeError(
            f"{what} has layout {tensor.layout}; collectives take dense tensors "
            "(use sparse_allreduce_async for sparse COO tensors, or .to_dense())")
    if tensor.dtype != torch.bfloat16 and not _has_an_array_type(tensor.dtype):
        names = ", ".join(str(t).replace("torch.", "") for t in SUPPORTED)
        raise TypeError(f"{what}: unsupported dtype {tensor.dtype}; mpitrain "
                        f"supports {names}")
    if tensor.is_neg():
        if writes:
            raise TypeError(f"{what} has its negative bit set (a lazy negation), so an "
                            "in-place result cannot reach it; call .resolve_neg() on "
                            "it first")
        tensor = tensor.resolve_neg()
    tensor = tensor.detach()
    if tensor.dtype != torch.bfloat16:
        return _shared(tensor, device)
    bits = _shared(tensor.view(torch.int16), device)
    try:
        return bits.view(_BFLOAT16)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: bfloat16 on a GPU needs CuPy 14 or later (this is "
                        f"CuPy {arrays.cupy().__version__}); upgrade it, or use "
                        "float16 or float32") from None


def _shared(tensor, device):
    """The numpy (CPU) or CuPy (CUDA) array over ``tensor``'s memory, strides kept."""
    if device == "cpu":
        return tensor.numpy()
    return arrays.cupy().from_dlpack(tensor)


@functools.lru_cache(None)
def _has_an_array_type(dtype):
    """Does numpy, and so CuPy, have a type for tensors of ``dtype``? The
    core refuses the ones it has but mpitrain does not reduce (bool, uint32),
    alike on both devices."""
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def as_tensor(array):
    """A tensor sharing ``array``'s memory (CuPy arrays stay on their GPU)."""
    bits = array.view(np.int16) if array.dtype == _BFLOAT16 else array
    tensor = _tensor(bits)
    return tensor.view(torch.bfloat16) if bits is not array else tensor


def _tensor(array):
    """The tensor over a numpy (host) or CuPy (CUDA) array's memory."""
    if arrays.of(array) in (arrays.HOST, None):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


class TensorHandle:
    """A pending collective whose result comes back as tensors.

    The core's ``poll`` and ``synchronize`` work on it: they call ``done``
    and ``wait``.
    """

    __slots__ = ("_handle", "_convert")

    def __init__(self, handle, convert):
        self._handle = handle
        self._convert = convert       # the core's result -> what synchronize returns

    def done(self):
        return self._handle.done()

    def wait(self):
        return self._convert(self._handle.wait())

    def __repr__(self):
        return f"<mpitrain.torch {self._handle!r}>"
