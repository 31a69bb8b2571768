"""How the job-wide set's host (CPU) allreduces and allgathers travel: MPI,
shared memory, or hierarchically, chosen once at init from the topology and
the settings.

Inside one node, a shared-memory segment beats MPI's allreduce on large
buffers (MPI's single-copy transfers still win on small ones). Across nodes,
MPITRAIN_HIERARCHICAL_ALLREDUCE reduces inside each node first, and
MPITRAIN_HIERARCHICAL_ALLGATHER gathers inside each node first. Process sets
other than the job-wide one always use MPI's collectives: their calls must not
block (mpitrain.transport.channel), and a segment per set would cost memory.
"""

import dataclasses
import logging
import os

from mpitrain.transport.hierarchical import (
    HierarchicalAllgather, HierarchicalAllreduce, MpiInsideNode)
from mpitrain.transport.shm import (
    DEFAULT_CHUNK_BYTES, SEGMENT_DIRECTORY, SharedMemoryAllreduce,
    SharedMemoryUnavailable, free_bytes, segment_bytes)

log = logging.getLogger("mpitrain")

# Below this, MPITRAIN_INTRA_NODE=auto leaves a buffer to MPI's allreduce,
# which is as fast or faster there (benchmarks/shm_allreduce.py).
AUTO_MIN_BYTES = 4 << 20
# A fused group streamed through the segment skips the fusion buffer's two
# copies, which MPI's allreduce needs: from this size up that wins (200 x
# 16 KiB on 2 ranks: 12% faster; 16 x 16 KiB: even).
AUTO_STREAM_MIN_BYTES = 256 << 10


@dataclasses.dataclass
class HostRoute:
    reducer: object = None     # .allreduce(buffer, op, io) generator; None: MPI's
    min_bytes: int = 0         # smaller buffers take MPI's allreduce
    description: str = "MPI's allreduce"
    gatherer: object = None    # .allgatherv(send, receive, counts); None: MPI's
    stream_min_bytes: int = 0  # the same for fused groups that stream (streamed=True)
    scatterer: object = None   # .reduce_scatter(send, receive, counts, op); None: MPI's

    def takes(self, nbytes, streamed=False):
        """Does the reducer take a buffer of nbytes? streamed: a fused group's
        tensors, streamed chunk by chunk (mpitrain.engine.execution.streaming)."""
        least = self.stream_min_bytes if streamed else self.min_bytes
        return self.reducer is not None and nbytes >= least

    def scatters(self, nbytes):
        """Does the scatterer take a reduce-scatter of nbytes in all? Smaller
        ones take MPI's, as smaller allreduces do."""
        return self.scatterer is not None and nbytes >= self.min_bytes

    def gathers(self, total_bytes):
        return self.gatherer is not None and self.gatherer.takes(total_bytes)

    def close(self):
        if self.reducer is not None:
            self.reducer.close()


class IntraNodeError(RuntimeError):
    """MPITRAIN_INTRA_NODE=shm cannot work here (raised on every rank)."""


def choose(topology, config):
    """The job's HostRoute; collective over the job's ranks, same on every rank."""
    route = _allreduce_route(topology, config)
    # several nodes: local_size < size is alike on every rank, cross_size is not
    if topology.local_size < topology.size and config.hierarchical_allgather:
        route.gatherer = HierarchicalAllgather(topology.comm, topology.local_comm,
                                               topology.cross_comm)
    return route


def _allreduce_route(topology, config):
    if topology.size == 1:
        return HostRoute(description="one rank: nothing to move")
    if topology.local_size == topology.size:        # alike on every rank, unlike cross_size
        return _inside_one_node(topology.comm, config)
    if not config.hierarchical_allreduce:
        return HostRoute(description="MPI's allreduce across nodes")
    if not topology.homogeneous:
        why = ("hierarchical allreduce needs the same number of ranks on every node, "
               f"and these nodes have {sorted(set(topology.local_sizes))}")
        if topology.rank == 0:
            log.warning("mpitrain: %s; allreduces use MPI's allreduce across all ranks",
                        why)
        return HostRoute(description=f"MPI's allreduce ({why})")
    # Every size goes this way: the user asked for it, and the step across
    # nodes is the one that counts.
    inside = _inside_one_node(topology.local_comm, config).reducer
    how = f"shared memory in {SEGMENT_DIRECTORY} (every size)"
    if inside is None:
        inside, how = MpiInsideNode(topology.local_comm, DEFAULT_CHUNK_BYTES), "MPI"
    return HostRoute(HierarchicalAllreduce(inside, topology.cross_comm),
                     description=f"hierarchical: {how} inside each of "
                                 f"{topology.cross_size} nodes, MPI across them")


def _inside_one_node(comm, config):
    """Shared memory among ranks of one node, where the settings allow it."""
    if config.intra_node == "mpi":
        return HostRoute(description="MPI's allreduce (MPITRAIN_INTRA_NODE=mpi)")
    try:
        reducer = SharedMemoryAllreduce(comm, DEFAULT_CHUNK_BYTES)
    except SharedMemoryUnavailable as error:
        if config.intra_node == "shm":
            raise IntraNodeError(
                f"MPITRAIN_INTRA_NODE=shm cannot work: {error}. Give the node more "
                "shared memory (docker run --shm-size=1g), or use "
                "MPITRAIN_INTRA_NODE=mpi") from None
        if comm.rank == 0:
            log.warning("mpitrain: %s; host allreduces use MPI's allreduce instead",
                        error)
        return HostRoute(description=f"MPI's allreduce (no shared memory: {error})")
    if config.intra_node == "shm":
        return HostRoute(reducer, 0, f"shared memory in {SEGMENT_DIRECTORY} "
                                     "(MPITRAIN_INTRA_NODE=shm)", scatterer=reducer)
    return HostRoute(reducer, AUTO_MIN_BYTES, f"shared memory in {SEGMENT_DIRECTORY} "
                     f"{_AUTO_SIZES}, MPI's allreduce below",
                     stream_min_bytes=AUTO_STREAM_MIN_BYTES, scatterer=reducer)


_AUTO_SIZES = (f"from {AUTO_MIN_BYTES >> 20} MiB up (fused tensors from "
               f"{AUTO_STREAM_MIN_BYTES >> 10} KiB)")


def describe_this_host(config, ranks=2):
    """Lines for `mpitrainrun --check-build`: what a job of ``ranks`` ranks on
    this machine would use for host allreduces, and why."""
    return [_shared_memory_here(config, ranks),
            "hierarchical allreduce across nodes: "
            + ("on" if config.hierarchical_allreduce
               else "off (MPITRAIN_HIERARCHICAL_ALLREDUCE=1 turns it on)"),
            "hierarchical allgather across nodes: "
            + ("on" if config.hierarchical_allgather
               else "off (MPITRAIN_HIERARCHICAL_ALLGATHER=1 turns it on)")]


def _shared_memory_here(config, ranks):
    if config.intra_node == "mpi":
        return "[ ] shared memory inside a node: off (MPITRAIN_INTRA_NODE=mpi)"
    needed = segment_bytes(DEFAULT_CHUNK_BYTES, ranks)
    try:
        free = free_bytes(SEGMENT_DIRECTORY)
    except OSError as error:
        return (f"[ ] shared memory inside a node: {SEGMENT_DIRECTORY} is missing "
                f"({error.strerror}): host allreduces use MPI's")
    if free < needed or not os.access(SEGMENT_DIRECTORY, os.W_OK):
        return (f"[ ] shared memory inside a node: {SEGMENT_DIRECTORY} has {free} bytes "
                f"free and {ranks} ranks need {needed}: host allreduces use MPI's")
    sizes = ("of every size (MPITRAIN_INTRA_NODE=shm)" if config.intra_node == "shm"
             else _AUTO_SIZES)
    return (f"[x] shared memory inside a node: {SEGMENT_DIRECTORY} ({free >> 20} MiB "
            f"free; {ranks} ranks use {needed >> 20} MiB), for host allreduces {sizes}")
