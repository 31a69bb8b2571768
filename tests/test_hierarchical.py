"""The hierarchical allreduce and allgather on "nodes" carved out of one
machine's ranks.

The multi-host tests (test_multihost.py) run them across real network
namespaces; here the ranks are split into nodes by hand, so the algorithms'
slicing is checked on 4 and 6 ranks quickly: the allreduce over both insides,
the allgather on nodes of consecutive ranks, of interleaved ranks and of
different sizes.
"""

import numpy as np
from mpi4py import MPI

from mpitrain.ops import ReduceOp
from mpitrain.transport.chunk_io import ChunkIO
from mpitrain.transport.hierarchical import (
    HierarchicalAllgather, HierarchicalAllreduce, MpiInsideNode)
from mpitrain.transport.shm import SharedMemoryAllreduce
from tests.mpi_harness import mpi_test

CHUNK = 4096            # bytes: small, so that buffers take many chunks


def carved_nodes(node_of=lambda rank, size: rank // 2):
    """(inside, cross) communicators of nodes; by default of two consecutive ranks."""
    world = MPI.COMM_WORLD
    inside = world.Split(color=node_of(world.rank, world.size), key=world.rank)
    cross = world.Split(color=inside.rank, key=world.rank)
    return inside, cross


def check_against_numpy(reducer):
    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    for dtype in (np.int64, np.float64, np.float32, np.uint8):
        for count in (0, 1, 5, 1000, 3 * CHUNK + 7):
            inputs = [((np.arange(count) * (k + 3)) % 13 - 6).astype(np.int64)
                      for k in range(size)]
            for op, combine in ((ReduceOp.SUM, np.sum), (ReduceOp.MAX, np.max),
                                (ReduceOp.MIN, np.min)):
                buffer = inputs[rank].astype(dtype)
                list(reducer.allreduce(buffer, op))
                stacked = np.stack([x.astype(dtype) for x in inputs])
                expected = combine(stacked, axis=0).astype(dtype)
                np.testing.assert_array_equal(buffer, expected,
                                              err_msg=f"{dtype} {count} {op}")


def check_fill_and_after(reducer):
    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    source = np.arange(2 * CHUNK, dtype=np.float64) + rank
    buffer = np.full(source.size, np.nan)
    seen = np.zeros(source.size, np.int64)

    class Doubled(ChunkIO):
        fills = True

        def fill(self, start, stop, destination):
            destination[...] = source[start:stop] * 2

        def reduced(self, start, stop):
            seen[start:stop] += 1

    list(reducer.allreduce(buffer, ReduceOp.SUM, Doubled()))
    want = 2 * (size * np.arange(source.size, dtype=np.float64) + sum(range(size)))
    np.testing.assert_array_equal(buffer, want)
    np.testing.assert_array_equal(seen, 1)


def check_over(make_inside):
    inside, cross = carved_nodes()
    reducer = HierarchicalAllreduce(make_inside(inside), cross)
    check_against_numpy(reducer)
    check_fill_and_after(reducer)
    reducer.close()


@mpi_test(np=(4, 6), init=False, timeout=60)
def test_over_shared_memory_inside_each_node():
    check_over(lambda inside: SharedMemoryAllreduce(inside, CHUNK))


@mpi_test(np=(4, 6), init=False, timeout=60)
def test_over_mpi_inside_each_node():
    check_over(lambda inside: MpiInsideNode(inside, CHUNK))


LAYOUTS = {
    "consecutive pairs": lambda rank, size: rank // 2,
    "interleaved": lambda rank, size: rank % 2,
    "uneven": lambda rank, size: 0 if rank < size - 1 else 1,
}


@mpi_test(np=(4, 6), init=False, timeout=60)
def test_allgather_equals_mpis_on_every_layout():
    world = MPI.COMM_WORLD
    for layout, node_of in LAYOUTS.items():
        check_allgather(layout, HierarchicalAllgather(world, *carved_nodes(node_of)))


def check_allgather(layout, gatherer):
    world = MPI.COMM_WORLD
    for parts in ([0] * world.size, [3, 0, 70000, 1, 5, 9][:world.size],
                  [k * 1001 + 17 for k in range(world.size)]):
        send = ((np.arange(parts[world.rank]) * 7 + world.rank) % 251).astype(np.uint8)
        got = np.full(sum(parts), 255, np.uint8)
        list(gatherer.allgatherv(send, got, parts))
        want = np.empty(sum(parts), np.uint8)
        world.Allgatherv(send, [want, parts])
        np.testing.assert_array_equal(got, want, err_msg=f"{layout} {parts}")
