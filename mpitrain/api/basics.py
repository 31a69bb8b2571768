"""mpitrain's running state: init() and shutdown(), topology and build queries."""

import atexit
import dataclasses
import os
import sys
import threading

from mpitrain.api import startup
from mpitrain.backends import arrays
from mpitrain.errors import ShutdownError, not_initialized_error
from mpitrain.runtime import config as _config


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
        watch = startup.StartWatch((config or _config.Config()).start_timeout)
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
        for set_id, controller in state.engine.controllers.items():
            controller.channel.close()
            if set_id != 0:           # the job-wide set's is the topology's
                controller.channel.comm.Free()
        state.topology.free()
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


def topology():
    """This rank's place in the job (mpitrain.runtime.topology.Topology)."""
    if _state is None:
        raise not_initialized_error()
    return _state.topology


def registered_sets():
    """The process sets registered on this rank, by id (an engine must be running)."""
    engine()
    return _state.sets


def rank():
    return topology().rank


def size():
    return topology().size


def local_rank():
    return topology().local_rank


def local_size():
    return topology().local_size


def cross_rank():
    return topology().cross_rank


def cross_size():
    return topology().cross_size


def is_homogeneous():
    return topology().homogeneous


def mpi_threads_supported():
    return topology().threads_multiple


def mpi_enabled():
    topology()
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
        from mpitrain.engine.timeline import Timeline
        running.set_timeline(Timeline(file_path, mark_cycles))


def stop_timeline():
    engine().set_timeline(None)
