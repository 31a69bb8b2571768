"""MPI start-up and the communicators mpitrain owns."""

import ctypes
import ctypes.util
import dataclasses
import logging
import os
import sys

log = logging.getLogger("mpitrain")

# Open MPI spins while a blocking call waits; with as many ranks as cores that
# steals the training thread's core. Yielding costs little latency.
_OPEN_MPI_DEFAULTS = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def start_mpi():
    """Import mpi4py's MPI module, initializing MPI with thread support."""
    if "mpi4py.MPI" not in sys.modules:
        for key, value in _OPEN_MPI_DEFAULTS.items():
            os.environ.setdefault(key, value)
        import mpi4py
        mpi4py.rc.thread_level = "multiple"
        mpi4py.rc.initialize = False        # MPI starts below, not at the import
        mpi4py.rc.finalize = True
    from mpi4py import MPI
    if MPI.Is_finalized():
        raise RuntimeError("MPI has already been finalized in this process")
    if not MPI.Is_initialized():
        _init_thread(MPI)
    return MPI


def _init_thread(MPI):
    """MPI_Init_thread, called through ctypes where the library can be found.

    MPI's start-up waits for every rank, forever if one never comes. mpi4py
    holds Python's lock while it waits, which would stop init()'s watch from
    ending the rank; a ctypes call lets go of it.
    """
    path = loaded_mpi_library()
    try:
        init_thread = ctypes.CDLL(path).MPI_Init_thread
    except (OSError, AttributeError, TypeError):
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return
    provided = ctypes.c_int(0)
    init_thread.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                            ctypes.POINTER(ctypes.c_int)]
    code = init_thread(None, None, MPI.THREAD_MULTIPLE, ctypes.byref(provided))
    if code != MPI.SUCCESS:
        raise RuntimeError(f"MPI_Init_thread failed with error code {code}")


def loaded_mpi_library():
    """The libmpi mapped into this process (mpi4py opened it), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmpi.so"):
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("mpi")


@dataclasses.dataclass
class Topology:
    comm: object               # private duplicate of the job's communicator
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    node: int                  # job rank of the first rank on this rank's node
    homogeneous: bool
    threads_multiple: bool
    local_sizes: list          # every rank's local_size, by job rank
    local_comm: object         # the ranks of this node
    cross_comm: object         # the ranks of this local rank on every node

    def free(self):
        for comm in (self.local_comm, self.cross_comm, self.comm):
            comm.Free()


def _job_communicator(MPI, comm):
    """Duplicate ``comm`` (None, an mpi4py communicator or a list of ranks)."""
    if comm is None:
        return MPI.COMM_WORLD.Dup()
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError("init(comm=...) got MPI.COMM_NULL")
        return comm.Dup()
    ranks = sorted(set(int(r) for r in comm))
    world = MPI.COMM_WORLD
    if not ranks or ranks[0] < 0 or ranks[-1] >= world.size:
        raise ValueError(
            f"init(comm={list(comm)}): ranks must lie in 0..{world.size - 1}")
    if world.rank not in ranks:
        raise ValueError(
            f"init(comm={list(comm)}): world rank {world.rank} is not in the list")
    group = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(group)
    finally:
        group.Free()


def warn_about_threads(topology):
    """Called once logging knows the rank."""
    if not topology.threads_multiple:
        log.warning(
            "MPI was initialized without MPI_THREAD_MULTIPLE; mpitrain's engine "
            "thread calls MPI, so do not call MPI from other threads, or let "
            "mpitrain initialize MPI (thread_level='multiple')")


def build(comm=None):
    MPI = start_mpi()
    provided = MPI.Query_thread()
    job = _job_communicator(MPI, comm)
    local = job.Split_type(MPI.COMM_TYPE_SHARED, key=job.rank)
    cross = job.Split(color=local.rank, key=job.rank)
    local_sizes = job.allgather(local.size)
    topology = Topology(
        comm=job, rank=job.rank, size=job.size,
        local_rank=local.rank, local_size=local.size,
        cross_rank=cross.rank, cross_size=cross.size,
        node=local.bcast(job.rank, root=0),
        homogeneous=len(set(local_sizes)) == 1,
        threads_multiple=provided >= MPI.THREAD_MULTIPLE,
        local_sizes=local_sizes, local_comm=local, cross_comm=cross)
    return topology
