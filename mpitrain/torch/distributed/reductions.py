"""torch.distributed's reduction ops as mpitrain's: (op, factor to scale inputs by).

PREMUL_SUM (which torch builds with ``_make_nccl_premul_sum(factor)``) is a
sum of inputs each multiplied by ``factor`` first: mpitrain's prescale. The
bitwise ops (BAND, BOR, BXOR) have no mpitrain counterpart; they fail on
every rank like any argument error.
"""

import torch.distributed as dist

from mpitrain.ops import Average, Max, Min, Product, Sum

_RED = dist.ReduceOp.RedOpType
_OPS = {_RED.SUM: Sum, _RED.AVG: Average, _RED.MIN: Min, _RED.MAX: Max,
        _RED.PRODUCT: Product}


def mpitrain_op(reduce_op):
    """(mpitrain op, prescale factor) of torch's ``reduce_op``.

    Raises ValueError for an op mpitrain does not reduce; callers turn it
    into a failure of the call on every rank.
    """
    kind = getattr(reduce_op, "op", reduce_op)     # a ReduceOp, or its RedOpType
    if kind == _RED.PREMUL_SUM:
        factor = reduce_op.factor
        return Sum, float(factor.item() if hasattr(factor, "item") else factor)
    try:
        return _OPS[kind], 1.0
    except KeyError:
        raise ValueError(f"the 'mpitrain' backend has no reduction op {kind.name} "
                         "(it reduces with SUM, AVG, MIN, MAX, PRODUCT and "
                         "PREMUL_SUM)") from None
