"""join: ranks out of data contribute zeros until everyone has joined."""

import time

import numpy as np
import pytest

import mpitrain as mt
from tests.mpi_harness import mpi_test


@mpi_test()
def test_joined_ranks_contribute_zeros_and_join_returns_the_last_rank():
    r, n = mt.rank(), mt.size()
    steps = r + 1                                  # rank k has k+1 batches
    for step in range(steps):
        got = mt.allreduce(np.full(4, 1.0), name="grad", op=mt.Sum)
        active = sum(1 for k in range(n) if k + 1 > step)
        np.testing.assert_array_equal(got, np.full(4, float(active)))
    assert mt.join() == n - 1


@mpi_test()
def test_average_still_divides_by_the_full_size():
    r, n = mt.rank(), mt.size()
    if r != 0:                                # rank 0 joins at once
        for _ in range(3):
            got = mt.allreduce(np.full(2, 6.0), name="avg")
            np.testing.assert_allclose(got, 6.0 * (n - 1) / n)
    if r == n - 1:
        time.sleep(0.5)
    assert mt.join() == n - 1


@mpi_test()
def test_allgather_while_a_rank_has_joined_is_an_error():
    r, n = mt.rank(), mt.size()
    if r == 0:
        mt.join()
    else:
        with pytest.raises(ValueError, match="not supported while rank"):
            mt.allgather(np.ones(2), name="gather.joined")
        mt.join()
    assert mt.allreduce(np.ones(1), op=mt.Sum, name="after.join")[0] == n


@mpi_test()
def test_join_repeatedly_with_cached_tensors():
    r, n = mt.rank(), mt.size()
    for epoch in range(3):
        batches = 2 + (r + epoch) % n
        for step in range(batches):
            handles = [mt.allreduce_async(np.full(3, 1.0), name=f"w.{i}", op=mt.Sum)
                       for i in range(4)]
            for handle in handles:
                result = mt.synchronize(handle)
                assert 1.0 <= result[0] <= n
        last = mt.join()
        assert 0 <= last < n


@mpi_test()
def test_unnamed_object_collectives_pair_up_after_a_refused_unnamed_allgather():
    # Horovod's test_horovod_join_allgather: the ranks whose unnamed allgather was
    # refused under join have counted one unnamed call more than rank 0.
    r, n = mt.rank(), mt.size()
    if r != 0:
        with pytest.raises(ValueError, match="not supported while rank"):
            mt.allgather(np.ones(2))
    last = mt.join()
    assert mt.allgather_object(last) == [last] * n
    assert mt.broadcast_object({"from": r} if r == n - 1 else None, root_rank=n - 1) \
        == {"from": n - 1}
