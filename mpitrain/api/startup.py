"""What init() does on every rank: MPI, the settings the ranks must share,
the process sets given at start, and a watch on ranks that never come.

Every check here ends in the same verdict on every rank, raised on every
rank, so that none goes on to wait for the others in a collective.
"""

import os
import sys
import threading

from mpitrain.api.process_sets import ProcessSet, global_process_set
from mpitrain.runtime import config as _config
from mpitrain.runtime import logs, start_marks


def start(comm, process_sets, config, problem):
    """Start MPI and the engine on this rank; returns (engine, topology, sets)."""
    from mpitrain.runtime import faults, slurm_step, topology
    MPI = topology.start_mpi()   # before any module that imports mpi4py.MPI
    lone_task = slurm_step.lone_task_problem(MPI.COMM_WORLD.Get_size())
    if lone_task:               # each task is its own world: no one else to tell
        raise RuntimeError(lone_task)
    from mpitrain.engine.loop import Engine, create_communicator
    from mpitrain.transport import host
    topo = topology.build(comm)
    try:
        _fail_everywhere(topo.comm, problem, "init()")
        static = _static_sets(process_sets, topo)
        cuda_aware, plan = _agree_on_settings(topo, config)
        logs.configure(topo.rank, config.log_level)
        route = host.choose(topo, config)
    except BaseException:
        topo.free()
        raise
    topology.warn_about_threads(topo)
    faults.abort_on_unhandled_exceptions(config.abort_on_exception)
    engine = Engine(topo, config, cuda_aware, plan, route)
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
    return engine, topo, sets


class StartWatch:
    """Ends this rank when init() waits too long for the others.

    A rank that exits (with status 0) before init() leaves the others inside
    MPI's start-up forever, where no exception can reach them; a rank that
    ends with an error makes the launcher end the whole job. The wait has a
    limit of its own (MPITRAIN_START_TIMEOUT), like torch's init timeout and
    Horovod's start timeout: a job that cannot start should not hold its
    machines for the stall shutdown's ten minutes.
    """

    def __init__(self, seconds):
        self.done = threading.Event()
        self._launch = start_marks.launch_facts()
        start_marks.mark_started(self._launch[0])
        if seconds:
            threading.Thread(target=self._watch, args=(seconds,), daemon=True,
                             name="mpitrain-init-watch").start()

    def _watch(self, seconds):
        if self.done.wait(seconds):
            return
        rank = "?" if self._launch[0] is None else self._launch[0]
        started = start_marks.who_started(*self._launch, start_marks.started_here())
        sys.stderr.write(
            f"mpitrain: init() on rank {rank} waited {seconds:g} s for the other ranks "
            f"to start: {started}. Ending this rank so that the job ends "
            "(MPITRAIN_START_TIMEOUT sets the wait).\n")
        sys.stderr.flush()
        os._exit(1)


def check_same_start(first, comm, process_sets):
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
    from mpitrain.transport import cuda_aware
    from mpitrain.transport import selection
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
    problem = ranks_problem(ranks, size)
    if problem:
        raise ValueError(problem)


def ranks_problem(ranks, size):
    if not ranks:
        return "a process set needs at least one rank"
    if ranks[-1] >= size:
        return (f"process set {ranks} names ranks beyond the job's "
                f"{size} ranks (0..{size - 1})")
    return ""
