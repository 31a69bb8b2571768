"""Reduce-scatter through the shared-memory segment (mpitrain.transport.shm)
against numpy: alone, interleaved with allreduces on the same segment, and
as users call it (mt.reducescatter, which takes it from 4 MiB up)."""

import numpy as np

import mpitrain as mt
from mpitrain.ops import ReduceOp
from mpitrain.transport.channel import even_split
from mpitrain.transport.shm import SharedMemoryAllreduce
from tests.mpi_harness import mpi_test
from tests.test_shm_allreduce import (
    CHUNK_BYTES, DTYPES, OPS, drive, expected, rank_input, world)


@mpi_test(np=(1, 2, 3), init=False)
def test_every_op_and_dtype_in_both_modes_equals_numpy():
    comm = world()
    for blocking in (True, False):
        reducer = SharedMemoryAllreduce(comm, CHUNK_BYTES, blocking=blocking)
        for dtype in DTYPES:
            for op in OPS:
                # a slot holds 4096 bytes: the largest spans several rounds;
                # fewer elements than ranks leave some blocks empty
                for total in (0, 1, 2 * comm.size + 1, 3001):
                    counts = even_split(total, comm.size)
                    inputs = [rank_input(rank, total, dtype, seed=total)
                              for rank in range(comm.size)]
                    low = sum(counts[:comm.rank])
                    receive = np.full(counts[comm.rank], 99, dtype)
                    drive(reducer.reduce_scatter(inputs[comm.rank], receive, counts, op))
                    np.testing.assert_array_equal(
                        receive, expected(op, inputs)[low:low + counts[comm.rank]],
                        err_msg=f"{op} of {total} {np.dtype(dtype)} in blocks {counts}, "
                                f"blocking={blocking}, rank {comm.rank}")
        reducer.close()


@mpi_test(np=(2, 3), init=False)
def test_interleaved_with_allreduces_on_the_same_slots():
    """Each call takes the slot that the last one's readers have left: a
    reduce-scatter of an odd number of rounds between allreduces shifts
    which slot comes next."""
    comm = world()
    for blocking in (True, False):
        reducer = SharedMemoryAllreduce(comm, CHUNK_BYTES, blocking=blocking)
        for call in range(6):
            total = 700 + 301 * call
            inputs = [rank_input(rank, total, np.float64, seed=call)
                      for rank in range(comm.size)]
            want = expected(ReduceOp.SUM, inputs)
            buffer = inputs[comm.rank].copy()
            drive(reducer.allreduce(buffer, ReduceOp.SUM))
            np.testing.assert_array_equal(buffer, want, err_msg=f"allreduce {call}")
            counts = even_split(total, comm.size)
            receive = np.empty(counts[comm.rank])
            drive(reducer.reduce_scatter(inputs[comm.rank], receive, counts,
                                         ReduceOp.SUM))
            low = sum(counts[:comm.rank])
            np.testing.assert_array_equal(receive, want[low:low + counts[comm.rank]],
                                          err_msg=f"reduce-scatter {call}")
        reducer.close()


@mpi_test(np=(2, 3), env={"MPITRAIN_INTRA_NODE": "auto"})
def test_users_reducescatter_takes_shared_memory_and_equals_numpy():
    r, n = mt.rank(), mt.size()
    assert mt.api.basics.engine().host_route.scatters(4 << 20)
    rows = 3 * n + 1                                       # uneven: rank 0 gets one more
    for dtype in (np.int32, np.float32, np.float64):
        inputs = [rank_input(k, rows * 400_000, dtype).reshape(rows, -1) for k in range(n)]
        counts = even_split(rows, n)
        mine = slice(sum(counts[:r]), sum(counts[:r + 1]))
        total = expected(ReduceOp.SUM, inputs)
        name = np.dtype(dtype).name
        got = mt.reducescatter(inputs[r], op=mt.Sum, name=f"{name}.sum")
        np.testing.assert_array_equal(got, total[mine], err_msg=f"{name} sum, rank {r}")
        if dtype != np.int32:
            got = mt.reducescatter(inputs[r], op=mt.Average, name=f"{name}.average")
            np.testing.assert_allclose(got, total[mine] / n, rtol=1e-6,
                                       err_msg=f"{name} average, rank {r}")
        got = mt.reducescatter(inputs[r], op=mt.Sum, prescale_factor=0.5,
                               postscale_factor=4.0, name=f"{name}.scaled")
        np.testing.assert_allclose(got, total[mine] * 2, err_msg=f"{name} scaled, rank {r}")
        assert not np.shares_memory(got, inputs[r])
