"""Host allreduces of the job-wide set across hosts, checked against numpy,
whichever route the job took (hierarchical or not; tests/test_multihost.py
runs it with each). Every rank prints "ROUTE R: <how its host allreduces
travel>" first and "allreduces right on rank R" once all checks hold.

Every rank builds every rank's input from the same seeds, so each computes
the reference itself: integer results must match it bit for bit, float sums
and averages up to the rounding of adding n terms in another order.
"""

import socket
import zlib

import numpy as np

import mpitrain as mt
from mpitrain.api.basics import engine

mt.init()
r, n = mt.rank(), mt.size()
print(f"ROUTE {r}: {engine().host_route.description}", flush=True)

MiB = 1 << 20
# Sizes in elements: one, odd ones that split unevenly between the ranks of
# a node, and several MiB, which take many 1 MiB chunks.
COUNTS = (1, 1001, 3 * MiB // 4 + 7)


def inputs(name, dtype, count):
    """Every rank's input for the case ``name``: the same on every rank."""
    arrays = []
    for k in range(n):
        rng = np.random.default_rng([zlib.crc32(name.encode()), k])
        if dtype == np.int8:
            arrays.append(rng.integers(-128, 128, count).astype(np.int8))
        elif np.issubdtype(dtype, np.integer):
            arrays.append(rng.integers(-1000, 1000, count).astype(dtype))
        else:
            arrays.append(rng.uniform(-10, 10, count).astype(dtype))
    return arrays


def reduce_both_ways(x, op, name):
    """The result out of place (x left untouched) and in place (into x)."""
    original = x.copy()
    out_of_place = mt.allreduce(x, op=op, name=f"{name}.out")
    np.testing.assert_array_equal(x, original)
    handle = mt.allreduce_async(x, op=op, name=f"{name}.in", output=x)
    assert mt.synchronize(handle) is x
    return out_of_place, x


def assert_close_to_sum(got, arrays, divisor=1):
    """got is sum(arrays) / divisor up to the rounding of n additions in any order."""
    eps = np.finfo(got.dtype).eps
    exact = np.sum([a.astype(np.float64) for a in arrays], axis=0) / divisor
    bound = (n + 1) * eps * np.sum([np.abs(a.astype(np.float64)) for a in arrays],
                                   axis=0) / divisor
    assert got.dtype == arrays[0].dtype
    error = np.abs(got.astype(np.float64) - exact)
    assert np.all(error <= bound), f"off by {(error - bound).max()} beyond rounding"


# Integer sums, bit for bit; int8 wraps around like numpy's
for dtype in (np.int8, np.int32, np.int64):
    for count in COUNTS:
        name = f"sum.{np.dtype(dtype).name}.{count}"
        arrays = inputs(name, dtype, count)
        want = np.sum(arrays, axis=0, dtype=dtype)
        for got in reduce_both_ways(arrays[r].copy(), mt.Sum, name):
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, want, err_msg=name)

# Float sums and averages
for dtype in (np.float32, np.float64):
    for count in COUNTS:
        for op, divisor in ((mt.Sum, 1), (mt.Average, n)):
            name = f"{op.name}.{np.dtype(dtype).name}.{count}"
            arrays = inputs(name, dtype, count)
            for got in reduce_both_ways(arrays[r].copy(), op, name):
                assert_close_to_sum(got, arrays, divisor)

# Min, max and product, exact
for dtype in (np.int32, np.float32, np.float64):
    count = COUNTS[-1]
    for op, combine in ((mt.Min, np.min), (mt.Max, np.max)):
        name = f"{op.name}.{np.dtype(dtype).name}"
        arrays = inputs(name, dtype, count)
        for got in reduce_both_ways(arrays[r].copy(), op, name):
            np.testing.assert_array_equal(got, combine(arrays, axis=0), err_msg=name)
# Factors from -4 to 4, whose products no order of multiplying rounds
for dtype in (np.int64, np.float64):
    arrays = [(np.arange(COUNTS[-1]) * (k + 3) % 9 - 4).astype(dtype) for k in range(n)]
    for got in reduce_both_ways(arrays[r].copy(), mt.Product, f"product.{dtype.__name__}"):
        np.testing.assert_array_equal(got, np.prod(arrays, axis=0))

# Many tensors at once, fused by the engine: in flight together and grouped,
# with pre- and postscaling, which fill the fused buffer on the way in
shapes = [(7 + 13 * i,) if i % 3 else (5, 11 + i) for i in range(48)]
many = [inputs(f"many.{i}", np.float32, int(np.prod(shape))) for i, shape in
        enumerate(shapes)]
handles = [mt.allreduce_async(arrays[r].reshape(shape), op=mt.Sum, name=f"many.{i}")
           for i, (arrays, shape) in enumerate(zip(many, shapes))]
for handle, arrays, shape in zip(handles, many, shapes):
    got = mt.synchronize(handle)
    assert got.shape == shape
    assert_close_to_sum(got.ravel(), arrays)
grouped = mt.grouped_allreduce([arrays[r].reshape(shape) for arrays, shape
                                in zip(many, shapes)], op=mt.Sum, name="grouped",
                               prescale_factor=0.5, postscale_factor=4.0)
for got, arrays in zip(grouped, many):
    assert_close_to_sum(got.ravel(), [a * 2 for a in arrays])

# A process set with a rank on either host travels over MPI, whatever the route
spanning = mt.add_process_set([0, n - 1])
if spanning.included():
    hostnames = mt.allgather_object(socket.gethostname(), process_set=spanning)
    assert hostnames[0] != hostnames[1], hostnames
    for count in COUNTS:
        name = f"spanning.{count}"
        arrays = inputs(name, np.int64, count)
        np.testing.assert_array_equal(
            mt.allreduce(arrays[r], op=mt.Sum, name=name, process_set=spanning),
            arrays[0] + arrays[n - 1])
mt.barrier()

print(f"allreduces right on rank {r}", flush=True)
