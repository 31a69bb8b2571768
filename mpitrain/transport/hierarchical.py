"""Hierarchical allreduce: inside each node, then across nodes, then inside again.

Every chunk is reduce-scattered among the ranks of a node (through shared
memory, or MPI's Reduce_scatter), each rank allreduces its reduced slice with
the ranks of the same local rank on the other nodes, and the node's ranks
gather the slices again. Each node then sends its data across the network
once, in local_size parallel pieces, instead of once per rank. It needs the
same number of ranks on every node, so that the slices line up.
"""

import numpy as np
from mpi4py import MPI

from mpitrain.transport.channel import MPI_TYPES, even_split, mpi_operation, starts_of
from mpitrain.transport.shm import unguarded


class HierarchicalAllreduce:
    """inside: an allreduce inside the node that takes ``across`` (a shared-
    memory one, or MpiInsideNode); cross: the ranks of this local rank on
    every node."""

    def __init__(self, inside, cross):
        self.inside = inside
        self.cross = cross

    def allreduce(self, buffer, op, fill=None, after=None, guard=unguarded):
        """As SharedMemoryAllreduce.allreduce, across every node."""
        operation = mpi_operation(op, buffer.dtype)
        datatype = MPI_TYPES[buffer.dtype]

        def across(piece):
            with guard("MPI_Allreduce across nodes"):
                self.cross.Allreduce(MPI.IN_PLACE, [piece, datatype], operation)
            yield from ()

        yield from self.inside.allreduce(buffer, op, fill, after, across, guard)

    def close(self):
        self.inside.close()


class MpiInsideNode:
    """The inside of a hierarchical allreduce over MPI: Reduce_scatter, then
    Allgatherv, a chunk at a time, on the node's communicator."""

    def __init__(self, comm, chunk_bytes):
        self.comm = comm
        self.chunk_bytes = chunk_bytes

    def allreduce(self, buffer, op, fill=None, after=None, across=None,
                  guard=unguarded):
        operation = mpi_operation(op, buffer.dtype)
        datatype = MPI_TYPES[buffer.dtype]
        per_chunk = max(1, self.chunk_bytes // buffer.itemsize)
        size, rank = self.comm.size, self.comm.rank
        for start in range(0, buffer.size, per_chunk):
            stop = min(start + per_chunk, buffer.size)
            chunk = buffer[start:stop]
            if fill is not None:
                fill(start, stop, chunk)
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
            if after is not None:
                after(start, stop)

    def close(self):
        pass
