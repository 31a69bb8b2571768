"""allreduce on numpy arrays: ops, dtypes, scaling, fusion, ordering, the cache."""

import logging

import ml_dtypes
import numpy as np

import mpitrain as mt
from mpitrain.backends.recycled import MIN_BYTES
from tests.mpi_harness import mpi_test

DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, ml_dtypes.bfloat16,
          np.float32, np.float64]


def rank_values(shape, dtype, rank):
    """Small values that every dtype holds exactly, different per rank."""
    count = int(np.prod(shape))
    return ((np.arange(count) % 5) + rank + 1).reshape(shape).astype(dtype)


@mpi_test(np=(1, 2, 3))
def test_sum_min_max_product_average_every_dtype():
    r, n = mt.rank(), mt.size()
    for dtype in DTYPES:
        inputs = [rank_values((3, 4), dtype, k).astype(np.float64) for k in range(n)]
        x = rank_values((3, 4), dtype, r)
        expected = {mt.Sum: sum(inputs), mt.Min: np.minimum.reduce(inputs),
                    mt.Max: np.maximum.reduce(inputs), mt.Product: np.prod(inputs, axis=0)}
        for op, want in expected.items():
            got = mt.allreduce(x, op=op, name=f"{np.dtype(dtype).name}.{op.name}")
            assert got.dtype == np.dtype(dtype) and got.shape == (3, 4)
            np.testing.assert_array_equal(got.astype(np.float64), want.astype(dtype).astype(np.float64))
        got = mt.allreduce(x, name=f"{np.dtype(dtype).name}.avg")
        want = (sum(inputs) / n).astype(dtype).astype(np.float64) \
            if np.dtype(dtype).kind == "f" or dtype == ml_dtypes.bfloat16 \
            else np.trunc(sum(inputs) / n)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2)


@mpi_test()
def test_8_bit_integer_sums_wrap_around_as_numpys_at_every_length():
    # Open MPI 5's vectorized sum saturates them from 64 elements on.
    for dtype in (np.uint8, np.int8):
        for count in (8, 64, 1000):
            x = np.full(count, 100 + mt.rank(), dtype)
            want = np.full(count, 0, dtype)
            for k in range(mt.size()):
                want += np.full(count, 100 + k, dtype)
            np.testing.assert_array_equal(
                mt.allreduce(x, op=mt.Sum, name=f"wrap.{np.dtype(dtype).name}.{count}"),
                want)


@mpi_test()
def test_average_is_the_default_op_and_average_flag_still_works():
    r, n = mt.rank(), mt.size()
    x = np.full(5, float(r), dtype=np.float32)
    mean = sum(range(n)) / n
    np.testing.assert_allclose(mt.allreduce(x), mean)
    np.testing.assert_allclose(mt.allreduce(x, average=True), mean)
    np.testing.assert_allclose(mt.allreduce(x, average=False), sum(range(n)))


@mpi_test(np=(1, 2, 3))
def test_input_is_not_modified_and_output_is_new():
    x = np.arange(10, dtype=np.float32) + mt.rank()
    before = x.copy()
    out = mt.allreduce(x, op=mt.Sum)
    np.testing.assert_array_equal(x, before)
    assert out is not x and not np.shares_memory(out, x)
    in_place = mt.allreduce_async(x, op=mt.Sum, output=x)
    assert mt.synchronize(in_place) is x
    np.testing.assert_array_equal(x, sum(before - mt.rank() + k for k in range(mt.size())))


@mpi_test(np=(1, 2, 3))
def test_results_held_keep_their_values_and_dropped_ones_lend_their_memory():
    """Out-of-place results are recycled, but never while anything holds them."""
    n = mt.size()
    small, large = (np.full(1000, mt.rank() + 1.0), np.full(300_000, mt.rank() + 1.0))
    for x in (small, large):
        want = sum(range(1, n + 1))
        held = mt.allreduce(x, op=mt.Sum, name="recycled")
        piece = mt.allreduce(x * 2, op=mt.Sum, name="recycled")[10:20]  # the rest dropped
        address = held.ctypes.data
        for step in range(3):                     # results of the same size come and go
            again = mt.allreduce(x * (step + 3), op=mt.Sum, name="recycled")
            np.testing.assert_array_equal(again, want * (step + 3))
            del again
        np.testing.assert_array_equal(held, want)
        np.testing.assert_array_equal(piece, want * 2)
        del held
        reused = mt.allreduce(x, op=mt.Sum, name="recycled")
        if x.nbytes >= MIN_BYTES:                 # smaller ones come from malloc's heap
            assert reused.ctypes.data == address
        np.testing.assert_array_equal(reused, want)


@mpi_test(np=(2,))
def test_steps_of_many_same_size_results_fault_in_no_fresh_memory():
    """A model has many gradients of one size, all held until the next step
    (ResNet-50's 3x3 convolutions of a stage). Each step's results take the
    memory the last step's dropped. Before, only two buffers of a size were
    kept: the rest came from malloc, whose reuse of freed memory depends on
    its history (1140 page faults a step on one rank, none on the other)."""
    import resource
    gradients = [np.full(300_000, mt.rank() + 1.0) for _ in range(12)]
    faults = []
    for step in range(30):
        handles = [mt.allreduce_async(g, op=mt.Sum, name=f"same.size.{i}")
                   for i, g in enumerate(gradients)]
        results = [mt.synchronize(handle) for handle in handles]
        assert all((result == 3.0).all() for result in results)
        del handles, results
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    per_step = (faults[-1] - faults[9]) / 20
    assert per_step < 100, f"{per_step:.0f} page faults per step"


@mpi_test(np=(1, 2, 3))
def test_prescale_and_postscale():
    r, n = mt.rank(), mt.size()
    x = np.full(4, r + 1.0, dtype=np.float64)
    got = mt.allreduce(x, op=mt.Sum, prescale_factor=2.0, postscale_factor=0.5)
    np.testing.assert_allclose(got, sum(k + 1.0 for k in range(n)))
    got = mt.allreduce(x, op=mt.Average, prescale_factor=3.0)
    np.testing.assert_allclose(got, 3.0 * sum(k + 1.0 for k in range(n)) / n)


@mpi_test(np=(1, 2, 3))
def test_16_bit_floats_accumulate_in_float32():
    """Summing in float16 would round after every rank; float32 rounds once."""
    r, n = mt.rank(), mt.size()
    values = np.float32([2049.0, 0.1, 65504.0 / 8, -3.3, 1e-4])
    for dtype in (np.float16, ml_dtypes.bfloat16):
        inputs = [(values + np.float32(k * 0.7)).astype(dtype) for k in range(n)]
        exact = sum(x.astype(np.float32) for x in inputs).astype(dtype)
        got = mt.allreduce(inputs[r], op=mt.Sum, name=f"wide.{np.dtype(dtype).name}")
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.astype(np.float32), exact.astype(np.float32))


@mpi_test(np=(1, 2, 3))
def test_scalars_empty_and_noncontiguous_arrays():
    r, n = mt.rank(), mt.size()
    assert mt.allreduce(np.float64(r), op=mt.Sum) == sum(range(n))
    assert mt.allreduce(np.zeros((0, 3), np.float32)).shape == (0, 3)
    base = np.arange(24, dtype=np.float32).reshape(4, 6) + r
    view = base[::2, 1::2]
    assert not view.flags.c_contiguous
    want = sum(np.arange(24, dtype=np.float32).reshape(4, 6)[::2, 1::2] + k for k in range(n))
    np.testing.assert_array_equal(mt.allreduce(view, op=mt.Sum), want)


@mpi_test()
def test_fifty_async_tensors_submitted_in_opposite_orders():
    r, n = mt.rank(), mt.size()
    order = range(60) if r % 2 == 0 else reversed(range(60))
    handles = {i: mt.allreduce_async(np.full(i + 1, float(r + i), np.float32),
                                     name=f"opposite.{i}", op=mt.Sum)
               for i in order}
    for i, handle in handles.items():
        np.testing.assert_array_equal(mt.synchronize(handle),
                                      np.full(i + 1, sum(k + i for k in range(n)), np.float32))


@mpi_test()
def test_poll_turns_true_and_synchronize_returns_the_result():
    handle = mt.allreduce_async(np.ones(3, np.float32), name="polled", op=mt.Sum)
    while not mt.poll(handle):
        pass
    np.testing.assert_array_equal(mt.synchronize(handle), np.full(3, mt.size(), np.float32))


@mpi_test()
def test_many_steps_reuse_names_through_the_cache():
    """The same names every step: after the first step no coordinator exchange."""
    r, n = mt.rank(), mt.size()
    controller = mt.api.basics.engine().controllers[0]
    shapes = [(7,), (3, 5), (1000,), (2, 2, 2)]
    for step in range(30):
        if step == 1:
            negotiations = controller.negotiations
        handles = [mt.allreduce_async(np.full(s, float(step + r), np.float32),
                                      name=f"step.{i}", op=mt.Sum)
                   for i, s in enumerate(shapes)]
        for handle, shape in zip(handles, shapes):
            np.testing.assert_array_equal(
                mt.synchronize(handle), np.full(shape, sum(step + k for k in range(n))))
    assert controller.negotiations == negotiations, \
        f"{controller.negotiations - negotiations} coordinator exchanges after warm-up"


@mpi_test(env={"MPITRAIN_FUSION_THRESHOLD": "0"})
def test_without_fusion_every_tensor_still_correct():
    r, n = mt.rank(), mt.size()
    handles = [mt.allreduce_async(np.full(10, float(r * i), np.float64), name=f"nofuse.{i}",
                                  op=mt.Sum) for i in range(20)]
    for i, handle in enumerate(handles):
        np.testing.assert_array_equal(mt.synchronize(handle),
                                      np.full(10, float(i * sum(range(n)))))


@mpi_test(env={"MPITRAIN_CACHE_CAPACITY": "4"})
def test_a_small_cache_evicts_and_stays_consistent():
    r, n = mt.rank(), mt.size()
    for step in range(5):
        names = [f"evict.{i}" for i in range(10)]
        if r == 1:
            names.reverse()
        handles = {name: mt.allreduce_async(np.full(3, float(r), np.float32), name=name,
                                            op=mt.Sum) for name in names}
        for handle in handles.values():
            np.testing.assert_array_equal(mt.synchronize(handle),
                                          np.full(3, float(sum(range(n)))))


@mpi_test()
def test_grouped_allreduce_returns_results_in_order():
    r, n = mt.rank(), mt.size()
    arrays = [np.full(k + 1, float(r + k), np.float32) for k in range(5)]
    results = mt.grouped_allreduce(arrays, op=mt.Sum, name="grouped")
    for k, result in enumerate(results):
        np.testing.assert_array_equal(result, np.full(k + 1, sum(j + k for j in range(n))))
    handle = mt.grouped_allreduce_async(arrays, name="grouped.async")
    assert [a.shape for a in mt.synchronize(handle)] == [a.shape for a in arrays]


@mpi_test()
def test_large_tensors_cross_several_chunks():
    r, n = mt.rank(), mt.size()
    big = np.full(3 * 1024 * 1024 + 17, float(r + 1), np.float32)    # 12 MiB
    small = np.full(100, float(r), np.float32)
    h1 = mt.allreduce_async(big, name="big", op=mt.Sum)
    h2 = mt.allreduce_async(small, name="small", op=mt.Sum)
    assert (mt.synchronize(h1) == sum(k + 1 for k in range(n))).all()
    assert (mt.synchronize(h2) == sum(range(n))).all()


@mpi_test(np=(3,))
def test_results_are_bitwise_identical_on_every_rank():
    from mpi4py import MPI
    rng = np.random.default_rng(mt.rank())
    arrays = [rng.standard_normal(s).astype(np.float32) for s in (13, 1000, 70000)]
    results = mt.grouped_allreduce(arrays, name="bitwise")
    digests = MPI.COMM_WORLD.allgather([r.tobytes() for r in results])
    assert all(d == digests[0] for d in digests)


@mpi_test(np=(2,))
def test_results_start_on_a_64_byte_boundary_so_frameworks_adopt_them():
    x = np.ones(10 * 1024 * 1024 + 3, np.float32)
    for result in (mt.allreduce(x), mt.allreduce(x[:100]), mt.allgather(x[:1000]),
                   mt.broadcast(x[:77], root_rank=0)):
        assert result.ctypes.data % 64 == 0 and result.flags.c_contiguous


@mpi_test()
def test_integer_averages_and_scaling_are_exact():
    """Summed in int64 and divided once: no overflow, no early truncation."""
    r, n = mt.rank(), mt.size()
    for dtype, value in ((np.uint8, 200), (np.int8, 100), (np.int8, -100),
                         (np.int16, 30000), (np.int32, 2 ** 31 - 1)):
        got = mt.allreduce(np.full(5, value, dtype), name=f"avg.{np.dtype(dtype)}.{value}")
        assert got.dtype == dtype and got.tolist() == [value] * 5, (dtype, got)
    mean = sum(k + 1 for k in range(n)) / n          # 1.5 or 2.0: rounds toward zero
    got = mt.allreduce(np.array([r + 1, -(r + 1)], np.int32), name="avg.toward.zero")
    assert got.tolist() == [int(mean), -int(mean)]
    x = np.array([3 + 2 * r], np.int32)             # the factor scales the sum
    got = mt.allreduce(x, op=mt.Sum, prescale_factor=0.5, name="int.prescale")
    assert got[0] == int(sum(3 + 2 * k for k in range(n)) * 0.5)
    big = np.array([2 ** 60 + 1 + r], np.int64)     # bits beyond float64's 53
    total = sum(2 ** 60 + 1 + k for k in range(n))
    assert mt.allreduce(big, name="int64.avg")[0] == total // n
    got = mt.allreduce(big, op=mt.Sum, postscale_factor=2.0, name="int64.scaled")
    assert got[0] == 2 * total
    summed = mt.allreduce(np.full(3, 200, np.uint8), op=mt.Sum, name="uint8.sum.wraps")
    assert summed.tolist() == [(200 * n) % 256] * 3                # as numpy's sum


@mpi_test()
def test_nan_under_min_and_max_whichever_rank_holds_it():
    r, n = mt.rank(), mt.size()
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        for holder in range(n):
            x = np.array([1.0 + r, 2.0, -3.0], dtype)
            if r == holder:
                x[0] = np.nan
            for op in (mt.Max, mt.Min):
                got = mt.allreduce(x, op=op, name=f"nan.{np.dtype(dtype)}.{holder}.{op}")
                assert np.isnan(float(got[0])), (dtype, holder, op, got)
                assert got[1:].astype(np.float32).tolist() == [2.0, -3.0]


@mpi_test(env={"MPITRAIN_CACHE_CAPACITY": "16"})
def test_more_names_per_step_than_the_cache_holds_grow_it_once_with_a_warning():
    """24 names every step against 16 entries: dropping the least recently
    used name would drop the next one needed, every step. The cache grows
    instead; names that never come back do not make it grow."""
    r, n = mt.rank(), mt.size()
    controller = mt.api.basics.engine().controllers[0]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("mpitrain").addHandler(handler)
    for step in range(6):
        if step == 2:
            negotiations = controller.negotiations
        handles = [mt.allreduce_async(np.full(3, float(r + i)), name=f"many.{i}",
                                      op=mt.Sum) for i in range(24)]
        for i, handle in enumerate(handles):
            assert (mt.synchronize(handle) == sum(k + i for k in range(n))).all()
    assert controller.negotiations == negotiations, "names still negotiate every step"
    assert controller.cache.capacity == 24, controller.cache.capacity
    for step in range(40):                      # a new name every step
        mt.allreduce(np.ones(2), name=f"once.{step}")
    assert controller.cache.capacity == 24, controller.cache.capacity
    logging.getLogger("mpitrain").removeHandler(handler)
    warnings = [record.getMessage() for record in records
                if "response cache" in record.getMessage()]
    assert warnings == ([] if r else ["the response cache holds 16 names, fewer than "
                                      "the job uses again and again: it grows to hold "
                                      "them. Set MPITRAIN_CACHE_CAPACITY to the number "
                                      "of tensors a step submits, or more, to start at "
                                      "that size"]), warnings
