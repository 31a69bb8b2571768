"""Collectives on numpy arrays, with Horovod's names and arguments.

Every ``*_async`` call returns a handle at once; ``synchronize(handle)``
waits for the result. Operations are matched across ranks by name, so
ranks may submit in different orders. Out-of-place calls never modify their
input; an input must not be modified while its operation is in flight.
"""

from mpitrain.api import basics
from mpitrain.api.argument_checks import Problem, checked_name, prepare
from mpitrain.api.process_sets import global_process_set
from mpitrain.engine import naming, submission
from mpitrain.engine.handles import GroupHandle, Handle, synchronize
from mpitrain.errors import ERROR_CLASSES
from mpitrain.ops import Average, OpType, Sum


# Module-level names: an enum attribute costs a lookup on every call.
ALLREDUCE, ALLGATHER, BROADCAST = OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST
ALLTOALL, REDUCESCATTER = OpType.ALLTOALL, OpType.REDUCESCATTER


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


def automatic_name(kind, process_set=global_process_set):
    """The name an unnamed call of ``kind`` on ``process_set`` gets now.

    For adapters that must know it before they submit: the backward pass of
    an autograd op derives its name from its forward's.
    """
    return submission.automatic_name(_controller(basics.engine(), process_set), kind)


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
        name = submission.automatic_name(controller, kind)
    name, site, bad_name = checked_name(name)
    handle, problem = prepare(controller, kind, array, name, op, prescale, postscale,
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
        name = submission.automatic_name(controller, kind)
    name, site, bad_name = checked_name(name)
    arrays = list(arrays)
    outputs = [None] * len(arrays) if outputs is None else list(outputs)
    prepared = [prepare(controller, kind, array, member, op, prescale, postscale,
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
        name = submission.automatic_name(controller, kind)
    name, site = naming.split(name) if type(name) is naming.AutoName else (str(name), "")
    names = [name] if count is None else group_names(name, count)
    _submit(engine, controller,
            [(Handle(member, kind, controller.rank, None, (), site=site),
              Problem(error_kind, problem)) for member in names])


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
        kind, submission.automatic_name(controller, kind), global_process_set, shape,
        None if problem is None else Problem("value", problem)))
