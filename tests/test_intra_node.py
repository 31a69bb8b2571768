"""Host allreduces of the job-wide set through shared memory (MPITRAIN_INTRA_NODE=shm),
as users call them: the results equal MPI's, whatever the call looks like."""

import ml_dtypes
import numpy as np

import mpitrain as mt
from tests.mpi_harness import mpi_test

SHM = {"MPITRAIN_INTRA_NODE": "shm"}


def route():
    return mt.api.basics.engine().host_route


def contributions(shape, dtype, rank):
    """Values that every dtype holds exactly, negative ones too (wrapped in
    unsigned types), different on every rank."""
    count = int(np.prod(shape))
    values = (np.arange(count) * 7 + rank * 3) % 11 - 5
    return values.reshape(shape).astype(np.int64).astype(dtype)


@mpi_test(env=SHM)
def test_the_job_uses_shared_memory_for_every_size():
    assert "shared memory" in route().description, route().description
    assert route().takes(np.zeros(1, np.float32).nbytes)


@mpi_test(env={"MPITRAIN_INTRA_NODE": "mpi"})
def test_mpi_setting_keeps_shared_memory_out():
    assert route().reducer is None and "MPITRAIN_INTRA_NODE=mpi" in route().description


def reference(inputs, op, dtype):
    """numpy's result: integers wrap around, 16-bit floats round once at the end."""
    wide = np.int64 if np.dtype(dtype).kind in "iu" else np.float64
    stacked = np.stack([x.astype(wide) for x in inputs])
    reduced = {mt.Sum: np.sum, mt.Min: np.min, mt.Max: np.max, mt.Product: np.prod}[op]
    return reduced(stacked, axis=0).astype(dtype)


@mpi_test(env=SHM)
def test_every_op_on_every_dtype_out_of_place_and_in_place():
    r, n = mt.rank(), mt.size()
    for dtype in (np.uint8, np.int8, np.int32, np.int64, np.float16,
                  ml_dtypes.bfloat16, np.float32, np.float64):
        inputs = [contributions((5, 30), dtype, k) for k in range(n)]
        for op in (mt.Sum, mt.Min, mt.Max, mt.Product):
            expected = reference(inputs, op, dtype)
            name = f"{np.dtype(dtype).name}.{op.name}"
            x = inputs[r].copy()
            np.testing.assert_array_equal(mt.allreduce(x, op=op, name=name), expected,
                                          err_msg=name)
            assert mt.synchronize(mt.allreduce_async(x, op=op, name=name + ".in",
                                                     output=x)) is x
            np.testing.assert_array_equal(x, expected, err_msg=name)


@mpi_test(env=SHM)
def test_averages_and_scale_factors():
    r, n = mt.rank(), mt.size()
    x = np.arange(3000, dtype=np.float32) + r
    mean = np.arange(3000, dtype=np.float32) + (n - 1) / 2
    np.testing.assert_allclose(mt.allreduce(x, name="avg"), mean, rtol=1e-6)
    np.testing.assert_allclose(
        mt.allreduce(x, op=mt.Sum, prescale_factor=0.5, postscale_factor=3.0,
                     name="scaled"), 1.5 * n * mean, rtol=1e-6)
    counts = np.full(10, 2 * r + 1, dtype=np.int64)
    np.testing.assert_array_equal(mt.allreduce(counts, name="int.avg"), n)


@mpi_test(env=SHM)
def test_fused_tensors_and_buffers_larger_than_a_chunk():
    r, n = mt.rank(), mt.size()
    shapes = [(17,), (1000, 3), (2, 3, 5), (300_001,), (1,)]
    handles = [mt.allreduce_async(contributions(shape, np.float32, r), op=mt.Sum,
                                  name=f"fused.{i}") for i, shape in enumerate(shapes)]
    for shape, handle in zip(shapes, handles):
        want = sum(contributions(shape, np.float32, k) for k in range(n))
        np.testing.assert_array_equal(mt.synchronize(handle), want)
    parts = [contributions(shape, np.float32, r) for shape in shapes]
    scaled = mt.grouped_allreduce(parts, op=mt.Sum, prescale_factor=0.5,
                                  postscale_factor=4.0, name="fused.scaled")
    for shape, got in zip(shapes, scaled):
        want = 2.0 * sum(contributions(shape, np.float32, k) for k in range(n))
        np.testing.assert_array_equal(got, want)
    big = np.linspace(-1, 1, 3 * (1 << 20) + 5, dtype=np.float64) * (r + 1)
    want = np.linspace(-1, 1, big.size, dtype=np.float64) * (n * (n + 1) / 2)
    np.testing.assert_allclose(mt.allreduce(big, op=mt.Sum, name="big"), want,
                               rtol=1e-12)


@mpi_test(env=SHM)
def test_fused_16_bit_averages_in_place_and_out_of_place():
    """Fused groups travel chunk by chunk from the inputs into shared memory
    and out into the outputs: each tensor gets its own part, widened and
    rounded once; a group with a strided output goes through the fusion
    buffer instead, with the same results."""
    r, n = mt.rank(), mt.size()
    for dtype in (np.float16, ml_dtypes.bfloat16):
        shapes = [(3, 7), (200_003,), (5,), (70_000, 2)]
        inputs = [[contributions(shape, dtype, k) for k in range(n)] for shape in shapes]
        wants = [(sum(x.astype(np.float64) for x in parts) / n).astype(dtype)
                 for parts in inputs]
        for strided in (False, True):
            outputs = [parts[r].copy() for parts in inputs]     # in place
            sources = list(outputs)
            if strided:
                outputs[2] = np.zeros((5, 2), dtype)[:, 0]
            handles = [mt.allreduce_async(source, name=f"{i}.{dtype.__name__}",
                                          output=output)
                       for i, (source, output) in enumerate(zip(sources, outputs))]
            for handle, output, want in zip(handles, outputs, wants):
                assert mt.synchronize(handle) is output
                np.testing.assert_array_equal(output, want)
        for got, want in zip(mt.grouped_allreduce([p[r] for p in inputs], name="grouped"),
                             wants):
            np.testing.assert_array_equal(got, want)


@mpi_test(env=SHM)
def test_a_non_contiguous_input_and_output():
    r, n = mt.rank(), mt.size()
    x = np.arange(40, dtype=np.float32).reshape(5, 8)[:, ::2] + r
    out = np.zeros((8, 5), dtype=np.float32).T[:, ::2]
    mt.synchronize(mt.allreduce_async(x, op=mt.Sum, name="strided", output=out))
    want = n * np.arange(40, dtype=np.float32).reshape(5, 8)[:, ::2] + sum(range(n))
    np.testing.assert_array_equal(out, want)


@mpi_test(env=SHM)
def test_nan_propagates_through_min_and_max_from_any_rank():
    x = np.zeros(4, np.float32)
    x[mt.rank() % 4] = np.nan
    for op in (mt.Min, mt.Max):
        got = mt.allreduce(x, op=op, name=f"nan.{op.name}")
        assert np.isnan(got[:min(mt.size(), 4)]).all(), got


@mpi_test(np=(3,), env=SHM)
def test_a_process_set_beside_the_shared_memory_job():
    evens = mt.add_process_set([0, 2])
    x = np.full(1000, mt.rank() + 1, np.float32)
    if mt.rank() in (0, 2):
        np.testing.assert_array_equal(
            mt.allreduce(x, op=mt.Sum, name="set", process_set=evens), 4)
    np.testing.assert_array_equal(mt.allreduce(x, op=mt.Sum, name="all"), 6)
    mt.remove_process_set(evens)
