"""The host backend: numpy arrays in this process's memory, and the numpy
helpers the engine packs, scales and allocates host buffers with.

They stand apart from arrays.py, which says which backend holds an array and
builds the CUDA one (cuda.py), so that cuda.py can share the integer
division here without importing the module that imports it.
"""

import math
import sys

import numpy as np

ALIGNMENT = 64   # frameworks adopt buffers aligned like this without copying them


def empty(shape, dtype):
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary.

    numpy's large allocations start 16 bytes past a page boundary, and
    TensorFlow copies any buffer it cannot adopt.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    flat = aligned_bytes(np.empty(nbytes + ALIGNMENT, dtype=np.uint8), nbytes).view(dtype)
    return flat if len(shape) == 1 else flat.reshape(shape)


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
