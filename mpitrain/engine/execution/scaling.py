"""Exact averages of int64 tensors, whose sum across ranks can overflow int64.

Narrower integers are averaged through a sum in int64, where the values of
any number of ranks fit (backends.dtypes.wire). The sum of int64 values may
not: [2**62 + rank] on 2 ranks wraps around. So each rank splits its values
before the sum into quotient and remainder by the set's size n,

    x = n * floor(x / n) + (x mod n),    0 <= x mod n < n,

and both are summed (one reduction of twice the elements). Then

    sum(x) / n = sum(quotients) + sum(remainders) / n,

where sum(remainders) < n * n cannot overflow, and sum(quotients) can wrap
only when the average itself is within n of int64's limits, where adding
sum(remainders) // n wraps it back. Horovod scales the wrapped sum in double,
and torch.distributed has no integer average; numpy's mean is a float64.
The data path (numpy or CuPy) needs only these elementwise operators.
"""

import numpy as np

from mpitrain.ops import ReduceOp

_INT64 = np.dtype(np.int64)


def splits(dtype, op, integer, size):
    """Does an allreduce of DType ``dtype`` send quotients and remainders?
    ``integer``: the executor's integer scaling, None where there is none.
    From the response and the set's size, so every rank decides the same."""
    return (size > 1 and integer is not None and op == ReduceOp.AVERAGE
            and dtype.numpy == _INT64)


def split(values, size, remainders):
    """values //= size (toward minus infinity), remainders = values mod size."""
    remainders[...] = values % size
    values //= size


def combine(quotients, remainders, size, scale):
    """quotients = (sum of the values split) * scale / size, truncated toward
    zero, from the summed ``quotients`` and ``remainders``; in place."""
    quotients += remainders // size         # the average, rounded toward minus infinity
    remainders %= size                      # and its fraction, in size-ths
    if scale == 1.0:
        quotients += (quotients < 0) & (remainders != 0)
        return
    # numpy's long double holds every int64 (64 bits of mantissa on x86); CuPy
    # has only float64, exact below 2**53, as its scale_integers.
    wide = np.longdouble if isinstance(quotients, np.ndarray) else np.float64
    quotients[...] = np.trunc((quotients.astype(wide) + remainders.astype(wide) / size)
                              * scale)
