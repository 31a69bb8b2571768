"""Array backends: numpy in host memory, CuPy on a CUDA device.

The engine packs, scales and unpacks through a backend, so the CPU and GPU
paths share every decision and differ only here (the device backend lives
in mpitrain.backends.cuda). CuPy is imported lazily, here and in the CUDA
backend and transports only: mpitrain imports and runs without it.
"""

import functools
import math
import sys
import warnings

import numpy as np

ALIGNMENT = 64   # frameworks adopt buffers aligned like this without copying them


def empty(shape, dtype):
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary.

    numpy's large allocations start 16 bytes past a page boundary, and
    TensorFlow copies any buffer it cannot adopt.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return aligned_bytes(np.empty(nbytes + ALIGNMENT, dtype=np.uint8),
                         nbytes).view(dtype).reshape(shape)


def aligned_bytes(owner, nbytes):
    """The first ``nbytes`` of the uint8 array ``owner`` (allocated ALIGNMENT
    bytes longer) that start on an ALIGNMENT boundary."""
    start = -host_address(owner) % ALIGNMENT
    return owner[start:start + nbytes]


def host_address(array):
    """Where the data of a numpy array starts in memory."""
    mpi = sys.modules.get("mpi4py.MPI")     # importing it here would start MPI
    if mpi is not None and array.flags.c_contiguous:
        # A tenth of the time of __array_interface__ or .ctypes, which
        # counts on paths run once per tensor.
        return mpi.buffer(array).address
    return array.__array_interface__["data"][0]


def scale_into(source, factor, out):
    """out = source * factor, computed in the wider float type, cast to out."""
    if factor == 1.0:
        out[...] = source      # casts like copyto(casting="unsafe"), in half the time
    elif out.dtype.kind == "f" and out.dtype.itemsize > source.dtype.itemsize:
        np.multiply(source, factor, out=out, dtype=out.dtype, casting="unsafe")
    else:
        np.multiply(source, factor, out=out, casting="unsafe")


def divide_toward_zero(values, divisor):
    """values / divisor, truncated toward zero, for numpy or CuPy integers
    (whose // rounds toward minus infinity)."""
    quotient = values // divisor
    quotient += (values < 0) & (quotient * divisor != values)
    return quotient


def scale_integers(values, scale, divisor):
    """values = values * scale / divisor in place, truncated toward zero.

    Exact for int64 sums: an integer division where scale is 1, else in
    numpy's long double (64 bits of mantissa on x86, where every int64 fits).
    """
    if scale == 1.0:
        values[...] = divide_toward_zero(values, divisor)
    else:
        values[...] = np.trunc(values.astype(np.longdouble) * np.longdouble(scale)
                               / divisor)


class Host:
    """numpy arrays in this process's memory."""

    device = -1

    @staticmethod
    def empty(shape, dtype):
        return empty(shape, dtype)

    scale_into = staticmethod(scale_into)
    scale_integers = staticmethod(scale_integers)

    @staticmethod
    def pack(sources, counts, out, factor):
        """Copy sources one after another into the 1-D ``out``, times factor.

        A source of None (a joined rank's share) contributes ``count`` zeros.
        """
        np.concatenate([np.zeros(count, out.dtype) if s is None
                        else s if s.ndim == 1 else s.reshape(-1)
                        for s, count in zip(sources, counts)],
                       out=out, casting="unsafe")
        if factor != 1.0:
            scale_into(out, factor, out)

    @staticmethod
    def unpack(buffer, offsets, views, outputs, factor):
        """Copy each view of the reduced buffer into its output, times factor."""
        for view, output in zip(views, outputs):
            scale_into(view, factor, output)

    @staticmethod
    def record_ready():
        """Host inputs are ready when submitted: nothing to wait for."""

    @staticmethod
    def wait_for_inputs(handles):
        """Host inputs are ready when submitted."""

    @staticmethod
    def settle():
        """Host work is finished when the call returns."""


HOST = Host()


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
