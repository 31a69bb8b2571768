"""The element types mpitrain moves, and how each one is reduced."""

import dataclasses

import ml_dtypes
import numpy as np

from mpitrain.ops import ReduceOp


@dataclasses.dataclass(frozen=True)
class DType:
    code: int
    numpy: np.dtype
    # MPI has no 16-bit float type that every library reduces, so 16-bit
    # floats are accumulated in float32 and rounded once at the end.
    reduce_as: np.dtype

    @property
    def name(self):
        return self.numpy.name


_SUPPORTED = [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64,
              np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
_WIDENED = {np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}

BY_CODE = []
_BY_NUMPY = {}
for _code, _t in enumerate(_SUPPORTED):
    _np = np.dtype(_t)
    _entry = DType(_code, _np,
                   np.dtype(np.float32) if _np in _WIDENED else _np)
    BY_CODE.append(_entry)
    _BY_NUMPY[_np] = _entry

SUPPORTED_NAMES = ", ".join(d.name for d in BY_CODE)


_INT64 = np.dtype(np.int64)


def wire(dtype, op, prescale, postscale):
    """The type a tensor of DType ``dtype`` is reduced in (its fusion buffer's).

    16-bit floats are summed in float32. Integers that are averaged or
    scaled are summed in int64, where the sum cannot overflow, and divided
    and scaled once, exactly, afterwards (see exact()); other integer
    sums wrap around as numpy's do.
    """
    if dtype.numpy.kind in "iu" and op in (ReduceOp.SUM, ReduceOp.AVERAGE) and (
            op == ReduceOp.AVERAGE or prescale != 1.0 or postscale != 1.0):
        return _INT64
    return dtype.reduce_as


def exact(wire_type, op):
    """Is the sum in ``wire_type`` scaled as an integer (scale_integers)?"""
    return wire_type.kind in "iu" and op in (ReduceOp.SUM, ReduceOp.AVERAGE)


def lookup(dtype):
    """Return the DType of a numpy dtype, or None when mpitrain cannot move it."""
    return _BY_NUMPY.get(dtype)
