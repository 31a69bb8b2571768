"""init_process_group under mpirun without MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE.

torch's default rendezvous (env://) wants those four variables, even for a
backend that needs no store. Under mpirun the job already knows its ranks:
where MASTER_ADDR is unset and the process is an MPI rank, the env://
handler this module installs starts mpitrain, takes rank and size from MPI,
and builds the store torch keeps for the job (gloo subgroups, object
collectives, send/recv) as a TCPStore on rank 0, whose address and port
travel to the other ranks by an mpitrain broadcast. Everywhere else torch's
own handler runs, unchanged, so this only turns torch's "environment
variable MASTER_ADDR expected" into a working start, for any backend.
"""

import os
import socket
import sys
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist
import torch.distributed.rendezvous  # noqa: F401  (the module, not the function of its name)

from mpitrain.api import basics, objects

# What Open MPI, MPICH and PMIx put into a rank's environment.
_MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def start_mpitrain():
    if not basics.is_initialized():
        basics.init()


def _launched_by_mpi():
    return any(variable in os.environ for variable in _MPI_RANK_VARIABLES)


def _asked(query, key):
    values = parse_qs(query).get(key)
    return int(values[0]) if values else -1


def check_place(rank, world_size, what):
    """Raise where a rank or size given to torch differs from MPI's."""
    for given, actual, name in ((rank, basics.rank(), "rank"),
                                (world_size, basics.size(), "world_size")):
        if given != -1 and given != actual:
            raise ValueError(
                f"{what} got {name}={given}, but MPI gives this process {name} "
                f"{actual}: the 'mpitrain' backend runs on the MPI job's ranks (leave "
                f"{name} out under mpirun)")


def _mpi_rendezvous(url, timeout=dist.constants.default_pg_timeout, **kwargs):
    """torch's rendezvous from MPI: (a TCPStore, MPI's rank, MPI's size)."""
    start_mpitrain()
    query = urlparse(url).query
    check_place(_asked(query, "rank"), _asked(query, "world_size"),
                "init_process_group")
    rank, size = basics.rank(), basics.size()
    store = None
    if rank == 0:
        host = "127.0.0.1" if basics.local_size() == size else socket.gethostname()
        store = dist.TCPStore(host, 0, size, True, timeout, wait_for_workers=False)
        address = (host, store.port)
    else:
        address = None
    host, port = objects.broadcast_object(address, 0, "torch.distributed rendezvous")
    if store is None:
        store = dist.TCPStore(host, port, size, False, timeout)
    yield store, rank, size
    raise RuntimeError("Unable to perform re-rendezvous using env:// under mpirun")


def install():
    """Put the MPI rendezvous in front of torch's env:// handler (once)."""
    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    torch_env = handlers["env"]
    if getattr(torch_env, "mpitrain_installed", False):
        return

    def env_or_mpi(url, **kwargs):
        if "MASTER_ADDR" not in os.environ and _launched_by_mpi():
            return _mpi_rendezvous(url, **kwargs)
        return torch_env(url, **kwargs)
    env_or_mpi.mpitrain_installed = True
    # torch's register_rendezvous_handler refuses a scheme twice; this wraps it.
    handlers["env"] = env_or_mpi
