"""Reduction operators and the kinds of collective requests."""

import enum


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operators, with Horovod's numeric values."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


class OpType(enum.IntEnum):
    """What a request asks the engine to do."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 7
    REMOVE_PROCESS_SET = 8
    ERROR = 9
    PARAMETERS = 10            # autotune's new settings, from the coordinator

    @property
    def label(self):
        return self.name.lower()


def resolve_op(op, average, default=Average):
    """Combine the deprecated ``average=`` flag with ``op=`` as Horovod does."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return default
    if type(op) is ReduceOp:
        return op
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"unknown reduction op {op!r}; use one of "
            "Average, Sum, Adasum, Min, Max, Product") from None


def adasum_size_problem(size):
    """Why op=Adasum cannot run on a process set of ``size`` ranks, or ""."""
    if size & (size - 1) == 0:
        return ""
    below = 1 << (size.bit_length() - 1)
    return (f"op=Adasum needs a power-of-two number of ranks (1, 2, 4, 8, ...), as "
            f"Horovod's does, and this process set has {size}: run {below} or "
            f"{below * 2} ranks, make a process set of {below}, or use op=Average")
