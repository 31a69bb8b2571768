"""Hierarchical collectives: inside each node, then across nodes, then inside again.

Allreduce: every chunk is reduce-scattered among the ranks of a node (through shared
memory, or MPI's Reduce_scatter), each rank allreduces its reduced slice with
the ranks of the same local rank on the other nodes, and the node's ranks
gather the slices again. Each node then sends its data across the network
once, in local_size parallel pieces, instead of once per rank. It needs the
same number of ranks on every node, so that the slices line up.

Allgather: each node's ranks gather their parts on the node's first rank,
the first ranks of the nodes exchange whole nodes' parts, and each first
rank broadcasts the result inside its node. Any layout works, even nodes of
different sizes, since only one rank per node talks across nodes.
"""

import numpy as np
from mpi4py import MPI

from mpitrain.transport.channel import (
    COUNT_LIMIT, MPI_TYPES, even_split, mpi_operation, starts_of)
from mpitrain.transport.chunk_io import PLAIN
from mpitrain.transport.shm import unguarded


class HierarchicalAllreduce:
    """inside: an allreduce inside the node that takes ``across`` (a shared-
    memory one, or MpiInsideNode); cross: the ranks of this local rank on
    every node."""

    def __init__(self, inside, cross):
        self.inside = inside
        self.cross = cross

    def allreduce(self, buffer, op, io=PLAIN, guard=unguarded):
        """As SharedMemoryAllreduce.allreduce, across every node."""
        operation = mpi_operation(op, buffer.dtype)
        datatype = MPI_TYPES[buffer.dtype]

        def across(piece):
            with guard("MPI_Allreduce across nodes"):
                self.cross.Allreduce(MPI.IN_PLACE, [piece, datatype], operation)
            yield from ()

        yield from self.inside.allreduce(buffer, op, io, across, guard)

    def close(self):
        self.inside.close()


class MpiInsideNode:
    """The inside of a hierarchical allreduce over MPI: Reduce_scatter, then
    Allgatherv, a chunk at a time, on the node's communicator."""

    def __init__(self, comm, chunk_bytes):
        self.comm = comm
        self.chunk_bytes = chunk_bytes

    def allreduce(self, buffer, op, io=PLAIN, across=None, guard=unguarded):
        """As SharedMemoryAllreduce.allreduce; io.read goes unused (fill serves)."""
        operation = mpi_operation(op, buffer.dtype)
        datatype = MPI_TYPES[buffer.dtype]
        per_chunk = max(1, self.chunk_bytes // buffer.itemsize)
        size, rank = self.comm.size, self.comm.rank
        for start in range(0, buffer.size, per_chunk):
            stop = min(start + per_chunk, buffer.size)
            chunk = buffer[start:stop]
            if io.fills:
                io.fill(start, stop, chunk)
            counts = even_split(stop - start, size)
            starts = starts_of(counts)[:-1]
            mine = np.empty(counts[rank], buffer.dtype)
            with guard("MPI_Reduce_scatter inside the node"):
                self.comm.Reduce_scatter([chunk, datatype], [mine, datatype], counts,
                                         operation)
            if across is not None:
                yield from across(mine)
            chunk[starts[rank]:starts[rank] + counts[rank]] = mine
            with guard("MPI_Allgatherv inside the node"):
                self.comm.Allgatherv(MPI.IN_PLACE, [chunk, counts, starts, datatype])
            io.arrived(buffer, start, stop)

    def close(self):
        pass


class HierarchicalAllgather:
    """local: the node's ranks; cross: the ranks of this local rank on every
    node (for local rank 0, the first rank of every node). Collective over
    the job's ranks, like every constructor here: it learns the layout."""

    def __init__(self, comm, local, cross):
        self.local = local
        self.cross = cross
        members = local.allgather(comm.rank)          # job ranks, in local order
        if local.rank == 0:
            nodes = cross.allgather(members)
        self.nodes = local.bcast(nodes if local.rank == 0 else None, root=0)
        self.members = members
        # Ranks numbered node by node: the nodes' parts, one after another,
        # are the result already, with nothing to reorder.
        self.in_node_order = [r for node in self.nodes for r in node] == list(
            range(comm.size))

    def takes(self, total_bytes):
        return total_bytes <= COUNT_LIMIT

    def allgatherv(self, send, receive, counts, guard=unguarded):
        """As Channel.allgatherv (byte views, counts in bytes per job rank)."""
        starts = starts_of(counts)
        mine = [counts[r] for r in self.members]
        node_counts = [sum(counts[r] for r in node) for node in self.nodes]
        first = self.local.rank == 0
        if first:
            node_part = np.empty(sum(mine), np.uint8)
            receiving = [node_part, mine, None, MPI.BYTE]
        with guard("MPI_Gatherv inside the node"):
            self.local.Gatherv([send, MPI.BYTE], receiving if first else None, root=0)
        if first:
            whole = receive if self.in_node_order else np.empty(receive.size, np.uint8)
            with guard("MPI_Allgatherv across nodes"):
                self.cross.Allgatherv([node_part, MPI.BYTE],
                                      [whole, node_counts, None, MPI.BYTE])
            if not self.in_node_order:
                at = 0
                for node in self.nodes:
                    for rank in node:
                        receive[starts[rank]:starts[rank + 1]] = whole[at:at + counts[rank]]
                        at += counts[rank]
        with guard("MPI_Bcast inside the node"):
            self.local.Bcast([receive, MPI.BYTE], root=0)
        yield from ()
