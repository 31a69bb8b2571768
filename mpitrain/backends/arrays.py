"""Array backends: which one holds an array, numpy in host memory (host.py)
or CuPy on a CUDA device (cuda.py), and whether CuPy and NCCL are here.

The engine packs, scales and unpacks through a backend, so the CPU and GPU
paths share every decision and differ only in the backend. CuPy is imported
lazily, here and in the CUDA backend and transports only: mpitrain imports
and runs without it.
"""

import functools
import warnings

import numpy as np

from mpitrain.backends.host import HOST


def cupy():
    """The cupy module, or None where it is missing or finds no CUDA device."""
    return _find_cupy()[0]


def why_no_cupy():
    """Why cupy() is None ("" where it is not)."""
    return _find_cupy()[1]


@functools.lru_cache(None)
def _find_cupy():
    try:
        import cupy as module
    except ImportError as error:
        if error.name == "cupy":
            return None, "CuPy is not installed"
        return None, f"CuPy fails to import: {error}"
    except Exception as error:       # a broken install fails in many ways
        return None, f"CuPy fails to import: {type(error).__name__}: {error}"
    try:
        count = module.cuda.runtime.getDeviceCount()
    except Exception as error:       # no driver, or one too old for this CuPy
        return None, f"CuPy finds no usable CUDA driver: {error}"
    if count < 1:
        return None, "CuPy finds no CUDA device"
    return module, ""


def of(array):
    """The backend that holds ``array``: HOST, a Device, or None if neither."""
    if type(array) is np.ndarray:
        return HOST
    module = cupy() if "cupy" in type(array).__module__ else None
    if module is not None and isinstance(array, module.ndarray):
        return device(array.device.id)
    return None


def as_array(value):
    """``value`` as an array mpitrain can move: CuPy arrays stay on the device."""
    if type(value) is np.ndarray or of(value) is not None:
        return value
    return np.asarray(value)


def overlapping(array):
    """May two elements of ``array`` (numpy or CuPy) share memory?

    True for a stride of 0 (expand(), broadcast_to()), which one result
    cannot be written into. Exact for every layout torch and CuPy make
    (C order, channels_last, transposed, sliced, reversed): each dimension's
    stride, smallest first, must step past all the smaller ones span; strides
    that interleave without overlapping (only as_strided makes them) count
    as overlapping too.
    """
    if array.flags.c_contiguous or array.size == 0:
        return False
    span = array.itemsize
    for stride, count in sorted((abs(stride), count) for stride, count
                                in zip(array.strides, array.shape) if count > 1):
        if stride < span:
            return True
        span += stride * (count - 1)
    return False


@functools.lru_cache(None)
def device(ordinal):
    from mpitrain.backends.cuda import Device
    return Device(cupy(), ordinal)


def nccl_version():
    """NCCL's version number where CuPy's NCCL bindings load, else 0."""
    return _find_nccl()[0]


def why_no_nccl():
    """Why nccl_version() is 0 ("" where it is not)."""
    return _find_nccl()[1]


@functools.lru_cache(None)
def _find_nccl():
    if cupy() is None:
        return 0, why_no_cupy()
    try:
        with warnings.catch_warnings():     # CuPy warns where the library is missing
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        if not nccl.available:
            return 0, "CuPy cannot load the NCCL library (libnccl.so.2)"
        return nccl.get_version(), ""
    except Exception as error:
        return 0, f"NCCL fails to load: {type(error).__name__}: {error}"


def current_device():
    """This rank's current CUDA device, for a joined rank that submitted nothing."""
    return device(cupy().cuda.runtime.getDevice())
