"""Every collective across hosts, checked number by number; run on 2 hosts x
2 ranks with the name of the network interface between the hosts as the
argument. Each rank prints "collectives right on rank R" when all hold.
tests/test_multihost.py."""

import socket
import sys
import time

import numpy as np

import mpitrain as mt

interface = sys.argv[1]
mt.init()
r, n = mt.rank(), mt.size()
assert n == 4 and mt.local_size() == 2 and mt.cross_size() == 2, "not 2 hosts x 2 ranks"


def bytes_sent():
    """Bytes this host has sent over the network between the hosts."""
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as counter:
        return int(counter.read())


def rank_values(rank, dtype, shape=(3, 4)):
    return (np.arange(np.prod(shape)).reshape(shape) % 7 + 3 * rank - 4).astype(dtype)


# allreduce: every op, float32 and int64, out of place and in place
for dtype in (np.float32, np.int64):
    inputs = np.stack([rank_values(k, np.float64) for k in range(n)])
    average = inputs.sum(0) / n if dtype == np.float32 else np.trunc(inputs.sum(0) / n)
    expected = {mt.Sum: inputs.sum(0), mt.Average: average,
                mt.Min: inputs.min(0), mt.Max: inputs.max(0)}
    for op, want in expected.items():
        x = rank_values(r, dtype)
        got = mt.allreduce(x, op=op, name=f"out.{op.name}.{np.dtype(dtype).name}")
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want.astype(dtype))
        np.testing.assert_array_equal(x, rank_values(r, dtype))      # input untouched
        assert mt.synchronize(mt.allreduce_async(
            x, op=op, name=f"in.{op.name}.{np.dtype(dtype).name}", output=x)) is x
        np.testing.assert_array_equal(x, want.astype(dtype))

# many tensors in flight at once, fused by the engine
handles = [mt.allreduce_async(np.full(10 + i, float(r * i), np.float32), op=mt.Sum,
                              name=f"many.{i}") for i in range(64)]
for i, handle in enumerate(handles):
    np.testing.assert_array_equal(mt.synchronize(handle),
                                  np.full(10 + i, float(i * sum(range(n)))))

# a large allreduce really crosses the network between the hosts
large = np.full(2 * 1024 * 1024, float(r + 1), np.float32)
mt.barrier()
before = bytes_sent()
np.testing.assert_array_equal(mt.allreduce(large, op=mt.Sum, name="large"),
                              float(sum(range(1, n + 1))))
mt.barrier()
assert bytes_sent() - before >= large.nbytes, (before, bytes_sent())

# allgather with a different first dimension on every rank
got = mt.allgather(np.full((r + 1, 3), r, np.int64), name="gather")
np.testing.assert_array_equal(got, np.concatenate([np.full((k + 1, 3), k)
                                                   for k in range(n)]))

# broadcast from a root on either host
for root in range(n):
    x = np.full((2, 5), float(r), np.float64)
    np.testing.assert_array_equal(mt.broadcast(x, root_rank=root, name=f"bcast.{root}"),
                                  float(root))

# alltoall: rank r sends k+1 rows of 100r+k to rank k
splits = [k + 1 for k in range(n)]
rows = np.concatenate([np.full((k + 1, 2), 100 * r + k, np.int32) for k in range(n)])
out, received = mt.alltoall(rows, splits=splits, name="a2a")
np.testing.assert_array_equal(received, [r + 1] * n)
np.testing.assert_array_equal(out, np.concatenate([np.full((r + 1, 2), 100 * k + r)
                                                   for k in range(n)]))

# reducescatter of 2n+1 rows: rank 0 gets the extra row
x = np.arange((2 * n + 1) * 3, dtype=np.float32).reshape(2 * n + 1, 3) * (r + 1)
total = np.arange((2 * n + 1) * 3, dtype=np.float32).reshape(2 * n + 1, 3) * 10
counts = [2 + (k == 0) for k in range(n)]
start = sum(counts[:r])
np.testing.assert_array_equal(mt.reducescatter(x, op=mt.Sum, name="scatter"),
                              total[start:start + counts[r]])

# barrier: nobody leaves before the last rank arrives
if r == n - 1:
    time.sleep(0.5)
started = time.monotonic()
mt.barrier()
assert r == n - 1 or time.monotonic() - started > 0.4

# objects
hosts = mt.allgather_object(socket.gethostname())
assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
got = mt.broadcast_object({"from": r, "host": socket.gethostname()}, root_rank=2)
assert got == {"from": 2, "host": hosts[2]}, got

# a process set with a rank on each host
spanning = mt.add_process_set([0, 2])
if spanning.included():
    assert mt.allgather_object(socket.gethostname(), process_set=spanning) \
        == [hosts[0], hosts[2]]
    np.testing.assert_array_equal(
        mt.allreduce(np.full(3, float(r)), op=mt.Sum, process_set=spanning), 2.0)
    np.testing.assert_array_equal(mt.allgather(np.array([r]), process_set=spanning),
                                  [0, 2])
    assert mt.broadcast(np.array([r]), root_rank=2, process_set=spanning)[0] == 2
mt.barrier()

print(f"collectives right on rank {r}", flush=True)
