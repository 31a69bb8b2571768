"""Start-up and shutdown, topology queries, build queries, process sets."""

import atexit
import dataclasses
import threading

from mpitrain import arrays
from mpitrain import config as _config
from mpitrain import logs
from mpitrain.errors import ShutdownError, not_initialized_error
from mpitrain.ops import OpType
from mpitrain.process_sets import ProcessSet, global_process_set


@dataclasses.dataclass
class _State:
    engine: object
    topology: object
    sets: dict            # process set id -> ProcessSet
    arguments: tuple      # (comm, process_sets) as init() was given them


_state = None
_init_lock = threading.Lock()
_atexit_registered = False


def init(comm=None, process_sets=None):
    """Start mpitrain on every rank; calling it again does nothing.

    comm: None (MPI.COMM_WORLD), an mpi4py communicator, or a list of ranks.
    process_sets: ProcessSet objects to register now, in the same order on
    every rank ("dynamic" is accepted: sets can always be added later).
    """
    global _state, _atexit_registered
    with _init_lock:
        if _state is not None and not _state.engine.stopped:
            _check_same_start(_state.arguments, comm, process_sets)
            return
        if _state is not None:
            _release(_state)
            _state = None
        try:
            config, problem = _config.from_environ(), ""
        except ValueError as error:     # raised below on every rank, not only here
            config, problem = None, str(error)
        from mpitrain import faults, topology
        from mpitrain.engine import Engine, create_communicator
        topo = topology.build(comm)
        try:
            _fail_everywhere(topo.comm, problem, "init()")
            static = _static_sets(process_sets, topo)
            cuda_aware, plan = _agree_on_settings(topo, config)
        except BaseException:
            topo.comm.Free()
            raise
        logs.configure(topo.rank, config.log_level)
        topology.warn_about_threads(topo)
        faults.abort_on_unhandled_exceptions(config.abort_on_exception)
        engine = Engine(topo, config, cuda_aware, plan)
        global_process_set.ranks = list(range(topo.size))
        global_process_set._attach(0, topo.rank)
        engine.add_set(0, global_process_set.ranks, topo.comm)
        sets = {0: global_process_set}
        for set_id, (ranks, process_set) in enumerate(static, start=1):
            engine.add_set(set_id, ranks, create_communicator(topo.comm, ranks))
            process_set = process_set or ProcessSet(ranks)
            process_set._attach(set_id, topo.rank)
            sets[set_id] = process_set
        engine.start()
        _state = _State(engine, topo, sets, (comm, process_sets))
        if not _atexit_registered:
            atexit.register(_stop_at_exit)
            _atexit_registered = True


def _check_same_start(first, comm, process_sets):
    """A second init() may repeat the first one's arguments, or give none."""
    first_comm, first_sets = first
    same_comm = comm is None or _described_comm(comm) == _described_comm(first_comm)
    same_sets = process_sets is None or _described_sets(process_sets) == \
        _described_sets(first_sets)
    if not (same_comm and same_sets):
        raise ValueError(
            f"mpitrain is already running, started with comm={first_comm!r} and "
            f"process_sets={first_sets!r}; init() with other arguments would be "
            "ignored. Call shutdown() first to start again with them, or add "
            "process sets with add_process_set()")


def _described_comm(comm):
    if comm is None:
        return "world"
    if isinstance(comm, (list, tuple, range)):
        return tuple(sorted(set(comm)))
    from mpi4py import MPI
    return "world" if comm == MPI.COMM_WORLD else id(comm)


def _described_sets(process_sets):
    if process_sets is None or process_sets == "dynamic":
        return ()
    return tuple(("comm", id(p.mpi_comm)) if isinstance(p, ProcessSet) and p.mpi_comm
                 else tuple(p.ranks) if isinstance(p, ProcessSet)
                 else tuple(sorted(set(p))) for p in process_sets)


def _static_sets(process_sets, topo):
    """The sets to register at init: (ranks, this rank's ProcessSet or None).

    Every rank names the same sets, except where a set comes from an mpi4py
    communicator: there each rank may name its own part of a partition, and
    every part is registered, in the order of the ranks that named it.
    """
    if process_sets is None or process_sets == "dynamic":
        process_sets = []       # still agreed on: other ranks may have listed sets
    try:
        static = [p if isinstance(p, ProcessSet) else ProcessSet(p) for p in process_sets]
        for process_set in static:
            process_set._resolve(topo.comm)
            _check_ranks(process_set.ranks, topo.size)
        problem = ""
    except (TypeError, ValueError) as error:
        problem = str(error)
    _fail_everywhere(topo.comm, problem, "init(process_sets=...)")
    named = [(tuple(p.ranks), p.mpi_comm is not None) for p in static]
    everyone = topo.comm.allgather(named)
    if any(len(other) != len(named) for other in everyone) \
            or not all(_agree(everyone, position) for position in range(len(named))):
        raise ValueError(
            "init(process_sets=...) must list the same sets on every rank (or, "
            "from communicators, parts that agree on who is in them); got "
            + "; ".join(f"rank {r}: {[list(ranks) for ranks, _ in sets]}"
                        for r, sets in enumerate(everyone)))
    registered, seen = [], {tuple(range(topo.size))}
    for position, process_set in enumerate(static):
        for ranks in dict.fromkeys(other[position][0] for other in everyone):
            if ranks in seen:
                raise ValueError(f"init(process_sets=...): {list(ranks)} is "
                                 "registered twice (the job-wide set has every rank)")
            seen.add(ranks)
            mine = ranks == tuple(process_set.ranks)
            registered.append((list(ranks), process_set if mine else None))
    return registered


def _agree_on_settings(topo, config):
    """Check that the settings every rank must share agree, and choose the
    transport of device buffers; returns (this rank's CUDA-awareness, the
    job's Plan). Every rank reaches the same verdict from the same reports."""
    from mpitrain.gpu import cuda_aware, selection
    aware = cuda_aware.resolve(config.cuda_aware)
    facts = selection.local_facts(topo.node, config.gpu_operations, aware)
    everyone = topo.comm.allgather((config, facts))
    plan, problem = None, _config.disagreement([c for c, _ in everyone])
    if not problem:
        try:
            plan = selection.choose([f for _, f in everyone])
        except ValueError as error:
            problem = str(error)
    _fail_everywhere(topo.comm, problem, "init()")
    return aware, plan


def _fail_everywhere(comm, problem, what):
    """Raise ValueError on every rank of ``comm`` when any rank has a problem,
    so that none goes on to wait for the others in a collective."""
    ranks_of = {}
    for rank, reported in enumerate(comm.allgather(problem)):
        if reported:
            ranks_of.setdefault(reported, []).append(rank)
    if ranks_of:
        raise ValueError(f"{what} failed on " + "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {reported}"
            for reported, ranks in ranks_of.items()))


def _agree(everyone, position):
    """Do the ranks agree on the sets at ``position``?

    Lists of ranks must be identical everywhere. A set from a communicator
    must be named identically by each of its members.
    """
    if not all(other[position][1] for other in everyone):
        return all(other[position] == everyone[0][position] for other in everyone)
    return all(everyone[member][position] == everyone[rank][position]
               for rank in range(len(everyone))
               for member in everyone[rank][position][0])


def _check_ranks(ranks, size):
    problem = _ranks_problem(ranks, size)
    if problem:
        raise ValueError(problem)


def _ranks_problem(ranks, size):
    if not ranks:
        return "a process set needs at least one rank"
    if ranks[-1] >= size:
        return (f"process set {ranks} names ranks beyond the job's "
                f"{size} ranks (0..{size - 1})")
    return ""


def shutdown():
    """Stop the engine on this rank; pending operations on every rank fail."""
    _stop("shutdown() was called")


def _stop_at_exit():
    _stop("its process exited")


def _stop(why):
    global _state
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


def is_initialized():
    return _state is not None and not _state.engine.stopped


def engine():
    """The running engine; raises when mpitrain is not initialized or stopped."""
    state = _state
    if state is None:
        raise not_initialized_error()
    if state.engine.stopped:
        raise ShutdownError(state.engine.stopped_reason)
    return state.engine


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
        problem = _ranks_problem(process_set.ranks, _state.topology.size)
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
