"""allgather, broadcast, alltoall, reducescatter, barrier and their grouped forms."""

import ml_dtypes
import numpy as np

import mpitrain as mt
from mpitrain.transport import channel
from mpitrain.transport.channel import COUNT_LIMIT
from tests.mpi_harness import mpi_test


@mpi_test()
def test_allgather_with_a_different_first_dimension_per_rank():
    r, n = mt.rank(), mt.size()
    for dtype in (np.uint8, np.int64, np.float16, ml_dtypes.bfloat16, np.float64):
        x = np.full((r + 1, 2, 3), r, dtype=dtype)
        got = mt.allgather(x, name=f"gather.{np.dtype(dtype).name}")
        want = np.concatenate([np.full((k + 1, 2, 3), k, dtype=dtype) for k in range(n)])
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


@mpi_test()
def test_allgather_of_empty_and_noncontiguous_arrays():
    r, n = mt.rank(), mt.size()
    empty = np.zeros((0, 4), np.float32) if r == 0 else np.ones((1, 4), np.float32)
    assert mt.allgather(empty).shape == (n - 1, 4)
    x = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2] + r
    want = np.concatenate([np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2] + k
                           for k in range(n)])
    np.testing.assert_array_equal(mt.allgather(x), want)


@mpi_test()
def test_grouped_allgather():
    r, n = mt.rank(), mt.size()
    results = mt.grouped_allgather([np.full(r + 1, r), np.full((1, 2), r * 10)])
    np.testing.assert_array_equal(results[0], np.concatenate([np.full(k + 1, k)
                                                              for k in range(n)]))
    assert results[1].shape == (n, 2)


@mpi_test()
def test_broadcast_from_every_root_leaves_the_input_alone():
    r, n = mt.rank(), mt.size()
    for root in range(n):
        x = np.full((2, 3), float(r), np.float32)
        got = mt.broadcast(x, root_rank=root, name=f"bcast.{root}")
        np.testing.assert_array_equal(got, np.full((2, 3), float(root)))
        np.testing.assert_array_equal(x, np.full((2, 3), float(r)))


@mpi_test()
def test_broadcast_in_place_into_a_noncontiguous_output():
    r = mt.rank()
    base = np.full((4, 4), float(r), np.float64)
    view = base[:, 1]
    handle = mt.broadcast_async(view, root_rank=0, name="bcast.inplace", output=view)
    mt.synchronize(handle)
    np.testing.assert_array_equal(base[:, 1], 0.0)
    np.testing.assert_array_equal(base[:, 0], float(r))


@mpi_test()
def test_alltoall_equal_and_uneven_splits():
    r, n = mt.rank(), mt.size()
    x = np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3) + 100 * r
    out, received = mt.alltoall(x, name="a2a.equal")
    np.testing.assert_array_equal(received, np.full(n, 2))
    want = np.concatenate([(np.arange(2 * n * 3, dtype=np.float32).reshape(2 * n, 3)
                            + 100 * k)[2 * r:2 * r + 2] for k in range(n)])
    np.testing.assert_array_equal(out, want)
    # rank k sends k+1 rows to each peer... except rank r+1 gets none
    splits = [(k + 1) if k != (r + 1) % n else 0 for k in range(n)]
    x = np.full((sum(splits), 2), r, np.int16)
    out, received = mt.alltoall(x, splits=splits, name="a2a.uneven")
    want_received = [0 if r == (k + 1) % n else r + 1 for k in range(n)]
    np.testing.assert_array_equal(received, want_received)
    np.testing.assert_array_equal(out, np.concatenate(
        [np.full((want_received[k], 2), k, np.int16) for k in range(n)]))


@mpi_test()
def test_reducescatter_sum_and_average_with_uneven_rows():
    r, n = mt.rank(), mt.size()
    rows = 2 * n + 1                            # one extra row: rank 0 gets it
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * (r + 1)
    total = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) * sum(range(1, n + 1))
    mine = slice(0, 3) if r == 0 else slice(1 + 2 * r, 3 + 2 * r)
    np.testing.assert_array_equal(mt.reducescatter(x, op=mt.Sum, name="rs.sum"), total[mine])
    np.testing.assert_allclose(mt.reducescatter(x, name="rs.avg"), total[mine] / n)
    half = mt.reducescatter(np.ones((n, 1), np.float16), op=mt.Sum, name="rs.half")
    assert half.dtype == np.float16 and half.shape == (1, 1) and half[0, 0] == n


@mpi_test()
def test_grouped_reducescatter():
    n = mt.size()
    results = mt.grouped_reducescatter([np.ones((n, 2)), np.ones((2 * n,))], op=mt.Sum)
    assert results[0].shape == (1, 2) and results[1].shape == (2,)
    assert (results[0] == n).all() and (results[1] == n).all()


@mpi_test()
def test_barrier_holds_every_rank_until_the_last_arrives():
    import time
    from mpi4py import MPI
    if mt.rank() == mt.size() - 1:
        time.sleep(0.5)
    mt.barrier()
    released = MPI.COMM_WORLD.allgather(time.time())
    arrived_late = released[-1]
    assert all(abs(t - arrived_late) < 0.3 for t in released), released


@mpi_test()
def test_async_calls_return_a_handle_at_once():
    import time
    if mt.rank() == 0:
        started = time.monotonic()
        handle = mt.allgather_async(np.ones(3), name="late")
        assert time.monotonic() - started < 0.1 and not mt.poll(handle)
        mt.synchronize(handle)
    else:
        time.sleep(0.3)
        mt.allgather(np.ones(3), name="late")


def gather_and_exchange_beyond_two_gibibytes(process_set):
    r = process_set.rank()
    mine = np.full((1 << 30) + 7, r + 1, dtype=np.uint8)
    both = mt.allgather(mine, name="big.allgather", process_set=process_set)
    assert both.size == 2 * mine.size                     # rank 1's offset passes 2**31
    assert both[0] == both[mine.size - 1] == 1 and both[mine.size] == both[-1] == 2
    del both, mine
    to_zero = (1 << 31) + 16                               # a count past 2**31
    rows = np.full(to_zero + 16, r + 1, dtype=np.uint8)
    rows[to_zero:] = 10 * (r + 1)
    received, splits = mt.alltoall(rows, splits=[to_zero, 16], name="big.alltoall",
                                   process_set=process_set)
    if r == 0:
        assert received.size == 2 * to_zero and list(splits) == [to_zero, to_zero]
        assert received[0] == received[to_zero - 1] == 1
        assert received[to_zero] == received[-1] == 2
    else:
        assert received.tolist() == [10] * 16 + [20] * 16


@mpi_test(np=(2,), timeout=180)
def test_allgather_and_alltoall_beyond_two_gibibytes():
    gather_and_exchange_beyond_two_gibibytes(mt.global_process_set)


@mpi_test(np=(3,), timeout=180)
def test_allgather_and_alltoall_beyond_two_gibibytes_on_a_process_set():
    pair = mt.add_process_set([0, 1])
    try:
        if pair.included():
            gather_and_exchange_beyond_two_gibibytes(pair)
    finally:
        mt.barrier()
        mt.remove_process_set(pair)


@mpi_test()
def test_alltoall_where_only_one_rank_passes_the_count_limit():
    """Issue 28's reproducer: rank 0 sends more than MPI's count limit (to
    itself on 2 ranks, to rank 1 on 3), every other pair one byte, so the
    other ranks alone would fit MPI's Alltoallv. Ranks that chose the route
    from their own sizes entered different MPI calls and waited there
    forever. The limit is lowered in this job: 2.2 GB would cost the shared
    test machine a minute (the tests beyond two gibibytes cover the real one)."""
    r, n = mt.rank(), mt.size()
    big, to = (1 << 10) + 1, 0 if n == 2 else 1
    splits = [big if r == 0 and k == to else 1 for k in range(n)]
    rows = np.full(sum(splits), r + 1, np.uint8)
    try:
        channel.COUNT_LIMIT = big - 1
        received, received_splits = mt.alltoall(rows, splits=splits, name="some.big")
    finally:
        channel.COUNT_LIMIT = COUNT_LIMIT
    sizes = [big if k == 0 and r == to else 1 for k in range(n)]
    assert received_splits.tolist() == sizes
    starts = np.cumsum([0] + sizes)
    assert received.size == starts[-1]
    for k in range(n):
        assert (received[starts[k]:starts[k + 1]] == k + 1).all(), k
