"""Argument checks of the collectives: a bad argument becomes a Problem that travels.

A call's arguments are checked on the rank that made it, before anything is
submitted. A bad one does not simply raise there: the call's handle is built
anyway, carries the Problem, and is submitted, so that the other ranks fail
the same name with this rank's reason instead of waiting for it
(mpitrain.api.array_ops).
"""

import bisect
import operator

import numpy as np

from mpitrain.api import basics
from mpitrain.backends import arrays, dtypes
from mpitrain.engine import naming
from mpitrain.engine.handles import Handle
from mpitrain.ops import Adasum, Average, OpType, ReduceOp, Sum, adasum_size_problem, resolve_op

ALLGATHER, BROADCAST = OpType.ALLGATHER, OpType.BROADCAST
ALLTOALL, REDUCESCATTER = OpType.ALLTOALL, OpType.REDUCESCATTER


class Problem(Exception):
    """An argument error found on this rank; the other ranks hear of it too."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


def prepare(controller, kind, array, name, op=Sum, prescale=1.0, postscale=1.0,
             root=-1, output=None, splits=None, average=None, site=""):
    """Build this rank's entry; a local argument error becomes a Problem.

    The arguments arrive as the caller gave them, so that a bad one still
    travels to the other ranks as the reason this operation failed.
    """
    problem = None
    if type(array) is np.ndarray:
        backend = arrays.HOST
    else:
        try:
            array = arrays.as_array(array)
        except Exception as error:      # a ragged list, an object numpy refuses
            problem = Problem(kind_of(error), "the input cannot be made an array: "
                                                f"{type(error).__name__}: {error}")
            array = np.zeros(0, np.uint8)
        backend = arrays.of(array)
    dtype = dtypes.lookup(array.dtype)
    try:
        op, prescale, postscale, root = _arguments(op, average, prescale, postscale, root)
        if kind == BROADCAST:
            root = _rank_in_set(controller, root)
    except Problem as bad_argument:
        op, prescale, postscale, root = Sum, 1.0, 1.0, -1
        problem = problem or bad_argument
    handle = Handle(name, kind, controller.rank, dtype, array.shape, op, prescale,
                    postscale, root, array, output, backend.device, site)
    if handle.device >= 0:
        handle.ready = backend.record_ready()
    if problem is None:
        try:
            _check(controller, handle)
            if kind == ALLTOALL:
                handle.splits = _alltoall_splits(array, splits, controller.size)
        except Problem as bad_input:
            problem = bad_input
    if problem is not None:
        handle.output = None             # it may be anything: never touched again
    return handle, problem


def kind_of(error):
    return "type" if isinstance(error, TypeError) else "value"


def checked_name(name):
    """(the name to submit under, its call site, a Problem or None).

    Names are strings; an unnamed call's (a naming.AutoName) knows where it
    was made. Another name still travels, as its str(), so that ranks that
    gave that string fail with this rank's error; its request stands for the
    call the other ranks make meanwhile under a name of their own (see
    mpitrain.engine.negotiation.refused), which fails too, instead of waiting for it.
    """
    if type(name) is str:
        return name, "", None
    if type(name) is naming.AutoName:
        return (*naming.split(name), None)
    return str(name), "", Problem("type", f"name must be a string, got "
                                           f"{type(name).__name__} {name!r}")


def _arguments(op, average, prescale, postscale, root):
    try:
        op = resolve_op(op, average)
    except ValueError as error:
        raise Problem("value", str(error)) from None
    try:
        prescale, postscale = float(prescale), float(postscale)
    except (TypeError, ValueError):
        raise Problem("value", "prescale_factor and postscale_factor must be numbers, "
                                f"got {prescale!r} and {postscale!r}") from None
    try:
        root = operator.index(root)
    except TypeError:
        raise Problem("value", f"root_rank must be a whole number, got {root!r}") from None
    return op, prescale, postscale, root


def _rank_in_set(controller, root):
    """The set's rank of the broadcast root ``root``, a rank of the job.

    root_rank counts in the job, as in Horovod; the engine counts in the set.
    """
    ranks = controller.ranks                 # sorted, as the set's communicator is
    position = bisect.bisect_left(ranks, root)
    if position < len(ranks) and ranks[position] == root:
        return position
    job_size = basics.size()
    if not 0 <= root < job_size:
        raise Problem("value", f"root_rank {root} is out of range for a job of "
                                f"{job_size} ranks")
    raise Problem("value", f"root_rank {root} is not a member of the process set, whose "
                            f"ranks are {list(ranks)} (root_rank is a rank of the job, "
                            "as in Horovod)")


_NEEDS_A_DIMENSION = frozenset({ALLGATHER, ALLTOALL, REDUCESCATTER})
_SCATTER_OPS = frozenset({Average, Sum})


def _check(controller, handle):
    if handle.dtype is None:
        raise Problem("type", f"unsupported dtype {handle.input.dtype}; mpitrain "
                               f"supports {dtypes.SUPPORTED_NAMES}")
    kind = handle.kind
    if handle.op == Adasum:
        _check_adasum(controller, handle)
    if kind in _NEEDS_A_DIMENSION:
        if handle.input.ndim == 0:
            raise Problem("value", f"{kind.label} needs an array with at least one "
                                    "dimension, got a scalar")
        if kind == REDUCESCATTER and handle.op not in _SCATTER_OPS:
            raise Problem("value", "reducescatter supports only op=Average and "
                                    f"op=Sum, got {ReduceOp(handle.op).name.capitalize()}")
    output, array = handle.output, handle.input
    if output is None:
        return
    if arrays.of(output) is None:
        raise Problem("type", "output= must be an array of the input's kind, got "
                               f"{type(output).__name__}")
    if output is not array and (output.shape != array.shape
                                or output.dtype != array.dtype
                                or arrays.of(output) is not arrays.of(array)):
        raise Problem("value", f"output of shape {output.shape} and dtype "
                                f"{output.dtype} cannot hold the result for input "
                                f"of shape {array.shape} and dtype {array.dtype} "
                                "(or it lives on another device)")
    # CuPy arrays are always writeable and have no such flag.
    if not getattr(output.flags, "writeable", True) and not (kind == BROADCAST
                                           and handle.root == controller.rank):
        raise Problem("value", "the output array is read-only")
    if arrays.overlapping(output):
        raise Problem("value", f"the output (shape {output.shape}, strides "
                                f"{output.strides} in bytes) has elements that share "
                                "memory, as expand() and broadcast_to() make, so no "
                                "result can be written into it; give a tensor of its "
                                "own, such as .clone()")


def _check_adasum(controller, handle):
    if handle.dtype.reduce_as.kind != "f":       # bfloat16 is a numpy "V" kind
        raise Problem("type", "op=Adasum combines floating-point tensors (float16, "
                               f"bfloat16, float32, float64), got {handle.dtype.name}")
    problem = adasum_size_problem(controller.size)
    if problem:
        raise Problem("notimplemented", problem)


def _alltoall_splits(array, splits, size):
    rows = array.shape[0]
    if splits is None:
        if rows % size:
            raise Problem("value", f"alltoall without splits needs a first "
                                    f"dimension divisible by {size} ranks, got {rows}")
        return np.full(size, rows // size, dtype=np.int64)
    values = np.asarray(splits).reshape(-1)
    whole = values.size == size and np.issubdtype(values.dtype, np.number) \
        and bool((values == np.round(values)).all())
    if not whole or (values.size and values.min() < 0):
        raise Problem("value", f"alltoall splits must be {size} non-negative "
                                f"whole numbers, one per rank, got {values.tolist()}")
    if int(values.sum()) != rows:
        raise Problem("value", f"alltoall splits {values.tolist()} add up to "
                                f"{int(values.sum())}, but the first dimension is {rows}")
    return values.astype(np.int64)
