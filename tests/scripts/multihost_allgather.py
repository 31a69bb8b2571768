"""Allgathers of the job-wide set across hosts, checked against what every
rank sent, whichever route the job took (tests/test_multihost.py runs it with
and without the hierarchical allgather, and with ranks placed host by host
or alternating between hosts). Every rank prints "GATHER R: hierarchical" or
"GATHER R: MPI" first, and "allgathers right on rank R" once all checks hold.
"""

import zlib

import numpy as np

import mpitrain as mt
from mpitrain.api.basics import engine

mt.init()
r, n = mt.rank(), mt.size()
hierarchical = engine().host_route.gatherer is not None
print(f"GATHER {r}: {'hierarchical' if hierarchical else 'MPI'}", flush=True)


def part(name, k, dtype, rows, row_shape):
    """Rank k's input for the case ``name``: every rank can make every rank's."""
    rng = np.random.default_rng([zlib.crc32(name.encode()), k])
    return rng.integers(-100, 100, (rows,) + row_shape).astype(dtype)


# First dimensions that differ between ranks, a rank with none, and rows of
# several MiB, with every dtype's bytes coming back where they belong
for dtype in (np.int8, np.int64, np.float32, np.float64):
    for row_shape, rows_of in (((), lambda k: 3 * k + 1), ((5, 7), lambda k: k % 2 * 4),
                               ((1 << 18,), lambda k: k + 1)):
        name = f"gather.{np.dtype(dtype).name}.{row_shape}"
        parts = [part(name, k, dtype, rows_of(k), row_shape) for k in range(n)]
        got = mt.allgather(parts[r], name=name)
        np.testing.assert_array_equal(got, np.concatenate(parts), err_msg=name)

# Several at once, fused into one response, and grouped
rows = [k + 2 for k in range(12)]
handles = [mt.allgather_async(part(f"many.{i}", r, np.float32, count, (3,)),
                              name=f"many.{i}") for i, count in enumerate(rows)]
for i, (handle, count) in enumerate(zip(handles, rows)):
    want = np.concatenate([part(f"many.{i}", k, np.float32, count, (3,))
                           for k in range(n)])
    np.testing.assert_array_equal(mt.synchronize(handle), want)
grouped = mt.grouped_allgather([part(f"group.{i}", r, np.int32, i + 1, (2,))
                                for i in range(4)], name="group")
for i, got in enumerate(grouped):
    np.testing.assert_array_equal(
        got, np.concatenate([part(f"group.{i}", k, np.int32, i + 1, (2,))
                             for k in range(n)]))
assert mt.allgather_object({"rank": r}) == [{"rank": k} for k in range(n)]
mt.barrier()

print(f"allgathers right on rank {r}", flush=True)
