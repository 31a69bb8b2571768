"""broadcast_object and allgather_object, including objects beyond 2 GiB."""

import numpy as np

import mpitrain as mt
from tests.mpi_harness import mpi_test


@mpi_test()
def test_broadcast_and_allgather_objects():
    r, n = mt.rank(), mt.size()
    state = {"lr": 0.1 * (r + 1), "steps": [r] * 3, "name": f"rank{r}"}
    assert mt.broadcast_object(state, root_rank=n - 1) == \
        {"lr": 0.1 * n, "steps": [n - 1] * 3, "name": f"rank{n - 1}"}
    assert mt.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]
    assert mt.allgather_object(None, name="nothing") == [None] * n


@mpi_test(np=(2,), timeout=120)
def test_objects_beyond_two_gibibytes():
    r = mt.rank()
    big = np.full((1 << 31) + 4096, r + 1, dtype=np.uint8) if r == 0 else None
    got = mt.broadcast_object(big, root_rank=0, name="big.object")
    assert got.size == (1 << 31) + 4096 and got[0] == 1 and got[-1] == 1
    del got, big
    mine = np.full((1 << 30) + 7, r + 1, dtype=np.uint8)
    both = mt.allgather_object(mine, name="big.gather")     # 2 GiB + 14 bytes in all
    assert [int(x[-1]) for x in both] == [1, 2] and both[1].size == (1 << 30) + 7
