"""Collectives on numpy arrays, with Horovod's names and arguments.

Every ``*_async`` call returns a handle at once; ``synchronize(handle)``
waits for the result. Operations are matched across ranks by name, so
ranks may submit in different orders. Out-of-place calls never modify their
input; an input must not be modified while its operation is in flight.
"""

import bisect
import operator

import numpy as np

from mpitrain.api import basics
from mpitrain.api.process_sets import global_process_set
from mpitrain.backends import arrays, dtypes
from mpitrain.engine import naming
from mpitrain.engine.handles import GroupHandle, Handle, synchronize
from mpitrain.errors import ERROR_CLASSES
from mpitrain.ops import (
    Adasum, Average, OpType, ReduceOp, Sum, adasum_size_problem, resolve_op)


# Module-level names: an enum attribute costs a lookup on every call.
ALLREDUCE, ALLGATHER, BROADCAST = OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST
ALLTOALL, REDUCESCATTER = OpType.ALLTOALL, OpType.REDUCESCATTER


class _Problem(Exception):
    """An argument error found on this rank; the other ranks hear of it too."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


def _controller(engine, process_set):
    set_id = process_set.process_set_id
    if set_id is None:
        raise ValueError(f"{process_set!r} is not registered: pass it to "
                         "init(process_sets=...) or add_process_set() first")
    controller = engine.controller_for(set_id)
    if controller is None:
        raise ValueError(f"this rank ({basics.rank()}) is not a member of "
                         f"{process_set!r}")
    return controller


def _prepare(controller, kind, array, name, op=Sum, prescale=1.0, postscale=1.0,
             root=-1, output=None, splits=None, average=None, site=""):
    """Build this rank's entry; a local argument error becomes a _Problem.

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
            problem = _Problem(_kind_of(error), "the input cannot be made an array: "
                                                f"{type(error).__name__}: {error}")
            array = np.zeros(0, np.uint8)
        backend = arrays.of(array)
    dtype = dtypes.lookup(array.dtype)
    try:
        op, prescale, postscale, root = _arguments(op, average, prescale, postscale, root)
        if kind == BROADCAST:
            root = _rank_in_set(controller, root)
    except _Problem as bad_argument:
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
        except _Problem as bad_input:
            problem = bad_input
    if problem is not None:
        handle.output = None             # it may be anything: never touched again
    return handle, problem


def _kind_of(error):
    return "type" if isinstance(error, TypeError) else "value"


def _checked_name(name):
    """(the name to submit under, its call site, a _Problem or None).

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
    return str(name), "", _Problem("type", f"name must be a string, got "
                                           f"{type(name).__name__} {name!r}")


def automatic_name(kind, process_set=global_process_set):
    """The name an unnamed call of ``kind`` on ``process_set`` gets now.

    For adapters that must know it before they submit: the backward pass of
    an autograd op derives its name from its forward's.
    """
    return _controller(basics.engine(), process_set).automatic_name(kind)


def _arguments(op, average, prescale, postscale, root):
    try:
        op = resolve_op(op, average)
    except ValueError as error:
        raise _Problem("value", str(error)) from None
    try:
        prescale, postscale = float(prescale), float(postscale)
    except (TypeError, ValueError):
        raise _Problem("value", "prescale_factor and postscale_factor must be numbers, "
                                f"got {prescale!r} and {postscale!r}") from None
    try:
        root = operator.index(root)
    except TypeError:
        raise _Problem("value", f"root_rank must be a whole number, got {root!r}") from None
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
        raise _Problem("value", f"root_rank {root} is out of range for a job of "
                                f"{job_size} ranks")
    raise _Problem("value", f"root_rank {root} is not a member of the process set, whose "
                            f"ranks are {list(ranks)} (root_rank is a rank of the job, "
                            "as in Horovod)")


_NEEDS_A_DIMENSION = frozenset({ALLGATHER, ALLTOALL, REDUCESCATTER})
_SCATTER_OPS = frozenset({Average, Sum})


def _check(controller, handle):
    if handle.dtype is None:
        raise _Problem("type", f"unsupported dtype {handle.input.dtype}; mpitrain "
                               f"supports {dtypes.SUPPORTED_NAMES}")
    kind = handle.kind
    if handle.op == Adasum:
        _check_adasum(controller, handle)
    if kind in _NEEDS_A_DIMENSION:
        if handle.input.ndim == 0:
            raise _Problem("value", f"{kind.label} needs an array with at least one "
                                    "dimension, got a scalar")
        if kind == REDUCESCATTER and handle.op not in _SCATTER_OPS:
            raise _Problem("value", "reducescatter supports only op=Average and "
                                    f"op=Sum, got {ReduceOp(handle.op).name.capitalize()}")
    output, array = handle.output, handle.input
    if output is None:
        return
    if arrays.of(output) is None:
        raise _Problem("type", "output= must be an array of the input's kind, got "
                               f"{type(output).__name__}")
    if output is not array and (output.shape != array.shape
                                or output.dtype != array.dtype
                                or arrays.of(output) is not arrays.of(array)):
        raise _Problem("value", f"output of shape {output.shape} and dtype "
                                f"{output.dtype} cannot hold the result for input "
                                f"of shape {array.shape} and dtype {array.dtype} "
                                "(or it lives on another device)")
    # CuPy arrays are always writeable and have no such flag.
    if not getattr(output.flags, "writeable", True) and not (kind == BROADCAST
                                           and handle.root == controller.rank):
        raise _Problem("value", "the output array is read-only")
    if arrays.overlapping(output):
        raise _Problem("value", f"the output (shape {output.shape}, strides "
                                f"{output.strides} in bytes) has elements that share "
                                "memory, as expand() and broadcast_to() make, so no "
                                "result can be written into it; give a tensor of its "
                                "own, such as .clone()")


def _check_adasum(controller, handle):
    if handle.dtype.reduce_as.kind != "f":       # bfloat16 is a numpy "V" kind
        raise _Problem("type", "op=Adasum combines floating-point tensors (float16, "
                               f"bfloat16, float32, float64), got {handle.dtype.name}")
    problem = adasum_size_problem(controller.size)
    if problem:
        raise _Problem("notimplemented", problem)


def _alltoall_splits(array, splits, size):
    rows = array.shape[0]
    if splits is None:
        if rows % size:
            raise _Problem("value", f"alltoall without splits needs a first "
                                    f"dimension divisible by {size} ranks, got {rows}")
        return np.full(size, rows // size, dtype=np.int64)
    values = np.asarray(splits).reshape(-1)
    whole = values.size == size and np.issubdtype(values.dtype, np.number) \
        and bool((values == np.round(values)).all())
    if not whole or (values.size and values.min() < 0):
        raise _Problem("value", f"alltoall splits must be {size} non-negative "
                                f"whole numbers, one per rank, got {values.tolist()}")
    if int(values.sum()) != rows:
        raise _Problem("value", f"alltoall splits {values.tolist()} add up to "
                                f"{int(values.sum())}, but the first dimension is {rows}")
    return values.astype(np.int64)


def _submit(engine, controller, prepared):
    """Enqueue prepared handles, or raise the first local problem.

    With a problem, every handle is still enqueued, carrying the error: the
    other ranks then fail the same names instead of waiting.
    """
    problems = [p for _, p in prepared if p is not None]
    handles = [handle for handle, _ in prepared]
    if not problems:
        if len(handles) == 1:
            conflict = engine.enqueue(controller, handles[0])
        else:
            conflict = engine.enqueue_many(controller, handles)
        if conflict is not None:
            _raise(controller, handles, "value", conflict)
        return handles
    first = problems[0]
    for handle in handles:
        handle.failed_locally = True
        handle.error = str(first)
        handle.error_kind = first.kind
    engine.enqueue_many(controller, handles)
    _raise(controller, handles, first.kind, first)


def _raise(controller, handles, kind, problem):
    names = ", ".join(f"'{handle.name}'" for handle in handles)
    raise ERROR_CLASSES[kind](f"{handles[0].kind.label} of {names} failed on "
                              f"{controller.rank_names([controller.rank])}: {problem}")


def _one(kind, array, name, process_set, op=Sum, prescale=1.0, postscale=1.0, root=-1,
         output=None, splits=None, average=None):
    engine = basics.engine()
    controller = _controller(engine, process_set)
    if name is None:
        name = controller.automatic_name(kind)
    name, site, bad_name = _checked_name(name)
    handle, problem = _prepare(controller, kind, array, name, op, prescale, postscale,
                               root, output, splits, average, site)
    if bad_name is not None:
        handle.name_refused, problem = True, bad_name
    if problem is None:
        conflict = engine.enqueue(controller, handle)
        if conflict is not None:
            _raise(controller, [handle], "value", conflict)
        return handle
    return _submit(engine, controller, [(handle, problem)])[0]


def _group(kind, arrays, name, process_set, outputs=None, op=Sum, prescale=1.0,
           postscale=1.0, average=None):
    engine = basics.engine()
    controller = _controller(engine, process_set)
    if name is None:
        name = controller.automatic_name(kind)
    name, site, bad_name = _checked_name(name)
    arrays = list(arrays)
    outputs = [None] * len(arrays) if outputs is None else list(outputs)
    prepared = [_prepare(controller, kind, array, member, op, prescale, postscale,
                         output=output, average=average, site=site)
                for member, array, output in zip(group_names(name, len(arrays)), arrays,
                                                 outputs)]
    if bad_name is not None:
        for handle, _ in prepared:
            handle.name_refused = True
        prepared = [(handle, bad_name) for handle, _ in prepared]
    return GroupHandle(_submit(engine, controller, prepared))


def group_names(name, count):
    """The names the members of a grouped call travel under."""
    return [f"{name}_{i}of{count}" for i in range(count)]


def allreduce_async(array, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, *,
                    output=None):
    """Start reducing ``array`` across the set; ``output`` receives it in place."""
    return _one(ALLREDUCE, array, name, process_set, op, prescale_factor,
                postscale_factor, output=output, average=average)


def allreduce(array, average=None, name=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    return synchronize(allreduce_async(array, average, name, op, prescale_factor,
                                       postscale_factor, process_set))


def grouped_allreduce_async(arrays, average=None, name=None, op=None,
                            prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set, *, outputs=None):
    return _group(ALLREDUCE, arrays, name, process_set, outputs, op, prescale_factor,
                  postscale_factor, average)


def grouped_allreduce(arrays, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async(arrays, average, name, op,
                                               prescale_factor, postscale_factor,
                                               process_set))


def allgather_async(array, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``array`` along the first dimension."""
    return _one(ALLGATHER, array, name, process_set)


def allgather(array, name=None, process_set=global_process_set):
    return synchronize(allgather_async(array, name, process_set))


def grouped_allgather_async(arrays, name=None, process_set=global_process_set):
    return _group(ALLGATHER, arrays, name, process_set)


def grouped_allgather(arrays, name=None, process_set=global_process_set):
    return synchronize(grouped_allgather_async(arrays, name, process_set))


def broadcast_async(array, root_rank, name=None, process_set=global_process_set, *,
                    output=None):
    """Start sending ``array`` from ``root_rank`` to the set's ranks.

    ``root_rank`` is a rank of the job (as in Horovod), and a member of the set.
    """
    return _one(BROADCAST, array, name, process_set, root=root_rank, output=output)


def broadcast(array, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async(array, root_rank, name, process_set))


def alltoall_async(array, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[i]`` rows to rank i; the result is (output, received splits)."""
    return _one(ALLTOALL, array, name, process_set, splits=splits)


def alltoall(array, splits=None, name=None, process_set=global_process_set):
    return synchronize(alltoall_async(array, splits, name, process_set))


def reducescatter_async(array, op=Average, name=None, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Start reducing ``array`` and scattering its rows; low ranks get any extra row."""
    return _one(REDUCESCATTER, array, name, process_set, op, prescale_factor,
                postscale_factor)


def reducescatter(array, op=Average, name=None, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    return synchronize(reducescatter_async(array, op, name, process_set,
                                           prescale_factor, postscale_factor))


def grouped_reducescatter_async(arrays, op=Average, name=None,
                                process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    return _group(REDUCESCATTER, arrays, name, process_set, op=op,
                  prescale=prescale_factor, postscale=postscale_factor)


def grouped_reducescatter(arrays, op=Average, name=None,
                          process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    return synchronize(grouped_reducescatter_async(arrays, op, name, process_set,
                                                   prescale_factor, postscale_factor))


def _control(kind, name, process_set, shape=(), problem=None):
    engine = basics.engine()
    controller = _controller(engine, process_set)
    handle = Handle(name, kind, controller.rank, None, shape)
    return _submit(engine, controller, [(handle, problem)])[0]


def fail(kind, name, process_set, error_kind, problem, count=None):
    """Raise this rank's ``problem`` with input it could not submit as ``name``
    (a grouped call of ``count`` members, where count is given).

    The other ranks, which submit ``name`` as usual, fail it too, naming
    this rank, instead of waiting for it.
    """
    engine = basics.engine()
    controller = _controller(engine, process_set)
    if name is None:
        name = controller.automatic_name(kind)
    name, site = naming.split(name) if type(name) is naming.AutoName else (str(name), "")
    names = [name] if count is None else group_names(name, count)
    _submit(engine, controller,
            [(Handle(member, kind, controller.rank, None, (), site=site),
              _Problem(error_kind, problem)) for member in names])


def barrier(process_set=global_process_set):
    """Wait until every rank of the set has called barrier()."""
    synchronize(_control(OpType.BARRIER, "barrier", process_set))


def join():
    """Declare this rank out of data; returns the rank that joined last.

    Until every rank has joined, this rank contributes zeros to the other
    ranks' allreduces (Average still divides by the full size).
    """
    return synchronize(_control(OpType.JOIN, "join", global_process_set))


def change_process_sets(engine, kind, shape, problem=None):
    """Add or remove a process set on every rank; a problem fails all ranks."""
    controller = _controller(engine, global_process_set)
    return synchronize(_control(
        kind, controller.automatic_name(kind), global_process_set, shape,
        None if problem is None else _Problem("value", problem)))
