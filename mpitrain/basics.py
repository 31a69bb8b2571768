"""mpitrain's running state: init() and shutdown(), topology and build queries, process sets."""

import atexit
import dataclasses
import os
import sys
import threading

from mpitrain import arrays, startup
from mpitrain import config as _config
from mpitrain.errors import ShutdownError, not_initialized_error
from mpitrain.ops import OpType
from mpitrain.process_sets import ProcessSet


@dataclasses.dataclass
class _State:
    engine: object
    topology: object
    sets: dict            # process set id -> ProcessSet
    arguments: tuple      # (comm, process_sets) as init() was given them
    pid: int


_state = None
_init_lock = threading.Lock()
_atexit_registered = False
_forked_from = None       # in a fork()ed child of a started rank: (rank, parent's pid)


def _note_fork():
    """A fork()ed child inherits mpitrain's state but not its engine thread,
    nor a place in the MPI job: collectives there would wait forever."""
    global _forked_from
    if _state is not None and _forked_from is None:
        _forked_from = (_state.topology.rank, _state.pid)


os.register_at_fork(after_in_child=_note_fork)


def init(comm=None, process_sets=None):
    """Start mpitrain on every rank; calling it again does nothing.

    comm: None (MPI.COMM_WORLD), an mpi4py communicator, or a list of ranks.
    process_sets: ProcessSet objects to register now, in the same order on
    every rank ("dynamic" is accepted: sets can always be added later).
    """
    global _state, _atexit_registered
    if _forked_from is not None:
        raise _forked_error()
    with _init_lock:
        if _state is not None and not _state.engine.stopped:
            startup.check_same_start(_state.arguments, comm, process_sets)
            return
        if _state is not None:
            _release(_state)
            _state = None
        try:
            config, problem = _config.from_environ(), ""
        except ValueError as error:     # raised below on every rank, not only here
            config, problem = None, str(error)
        watch = startup.StartWatch(_config.Config().stall_shutdown_time if config is None
                                   else config.stall_shutdown_time)
        try:
            engine, topo, sets = startup.start(comm, process_sets, config, problem)
        finally:
            watch.done.set()
        _state = _State(engine, topo, sets, (comm, process_sets), os.getpid())
        if not _atexit_registered:
            atexit.register(_stop_at_exit)
            _atexit_registered = True


def shutdown():
    """Stop the engine on this rank; pending operations on every rank fail."""
    _stop("shutdown() was called")


def _stop_at_exit():
    state = _state
    _stop("its process exited")
    if state is not None and state.engine.watch.abandoned:
        # The engine thread is inside an MPI call that cannot complete; MPI's
        # own finalization would wait for it forever.
        sys.stderr.write(f"mpitrain: rank {state.topology.rank}'s engine is still "
                         "inside an MPI call that cannot complete; aborting the MPI "
                         "job so that it ends\n")
        sys.stderr.flush()
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)


def _stop(why):
    global _state
    if _forked_from is not None:      # the parent's engine is not ours to stop
        return
    with _init_lock:
        state, _state = _state, None
    if state is None:
        return
    state.engine.stop(why)
    _release(state)


def _release(state):
    for process_set in state.sets.values():
        process_set._detach()
    if state.engine.clean_stop:
        for controller in state.engine.controllers.values():
            controller.channel.comm.Free()
        state.engine.watch.free()


def is_initialized():
    """True where collectives can run: not before init(), nor in a fork()ed child."""
    return _forked_from is None and _state is not None and not _state.engine.stopped


def engine():
    """The running engine; raises when mpitrain is not initialized or stopped."""
    state = _state
    if _forked_from is not None:
        raise _forked_error()
    if state is None:
        raise not_initialized_error()
    if state.engine.stopped:
        raise ShutdownError(state.engine.stopped_reason)
    return state.engine


def _forked_error():
    rank, pid = _forked_from
    return RuntimeError(
        f"this process (pid {os.getpid()}) is a fork() of rank {rank} (pid {pid}), "
        "which started mpitrain; a forked child has neither mpitrain's engine nor a "
        "place in the MPI job, so collectives here would never complete. Run them in "
        "the rank's own process (data-loader workers must not call them); rank(), "
        "size() and the other queries still answer here")


def _topology():
    if _state is None:
        raise not_initialized_error()
    return _state.topology


def rank():
    return _topology().rank


def size():
    return _topology().size


def local_rank():
    return _topology().local_rank


def local_size():
    return _topology().local_size


def cross_rank():
    return _topology().cross_rank


def cross_size():
    return _topology().cross_size


def is_homogeneous():
    return _topology().homogeneous


def mpi_threads_supported():
    return _topology().threads_multiple


def mpi_enabled():
    _topology()
    return True


def mpi_built():
    return True


def gloo_enabled():
    return False


def gloo_built():
    return False


def nccl_built():
    """NCCL's version number where CuPy's NCCL bindings load, else 0."""
    return arrays.nccl_version()


def ddl_built():
    return False


def ccl_built():
    return False


def cuda_built():
    """True where CuPy finds a CUDA device: device arrays can then be reduced."""
    return arrays.cupy() is not None


def rocm_built():
    return False


def start_timeline(file_path, mark_cycles=False):
    """Start writing a timeline on rank 0 (other ranks ignore the call)."""
    running = engine()
    if _state.topology.rank == 0:
        from mpitrain.timeline import Timeline
        running.set_timeline(Timeline(file_path, mark_cycles))


def stop_timeline():
    engine().set_timeline(None)


def add_process_set(process_set):
    """Register a new process set; every rank must call this in the same order."""
    from mpitrain import array_ops
    running = engine()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    try:                             # a problem is reported by every rank
        process_set._resolve(_state.topology.comm)
        problem = startup.ranks_problem(process_set.ranks, _state.topology.size)
    except ValueError as error:
        problem = str(error)
    for existing in _state.sets.values():
        if existing.ranks == process_set.ranks:
            problem = (f"a process set with ranks {process_set.ranks} is "
                       f"already registered: {existing!r}")
    set_id = array_ops.change_process_sets(
        running, OpType.ADD_PROCESS_SET, tuple(process_set.ranks), problem or None)
    process_set._attach(set_id, _state.topology.rank)
    _state.sets[set_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Unregister a process set on every rank; its pending operations fail."""
    from mpitrain import array_ops
    running = engine()
    set_id = process_set.process_set_id
    problem = None            # reported by every rank, not only here
    if set_id is None or _state.sets.get(set_id) is not process_set:
        problem = f"{process_set!r} is not registered"
    elif set_id == 0:
        problem = "the job-wide process set cannot be removed"
    array_ops.change_process_sets(running, OpType.REMOVE_PROCESS_SET,
                                  (-1 if problem else set_id,), problem)
    del _state.sets[set_id]
    process_set._detach()
    return True
