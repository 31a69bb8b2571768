"""mpitrain.torch collectives on tensors: dtypes, in place, async, errors."""

import time

import numpy as np
import pytest
import torch

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test

torch.set_num_threads(1)

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def rank_tensor(shape, dtype, rank):
    """Small values that every dtype holds exactly, different per rank."""
    count = int(np.prod(shape))
    return ((torch.arange(count) % 5) + rank + 1).reshape(shape).to(dtype)


def raises_everywhere(error, pattern, call):
    with pytest.raises(error, match=pattern) as caught:
        call()
    return str(caught.value)


@mpi_test()
def test_allreduce_of_every_dtype_in_and_out_of_place():
    r, n = hvd.rank(), hvd.size()
    for dtype in DTYPES:
        label = str(dtype).replace("torch.", "")
        inputs = [rank_tensor((3, 4), dtype, k).double() for k in range(n)]
        total = sum(inputs)
        x = rank_tensor((3, 4), dtype, r)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{label}")
        assert got.dtype == dtype and got.shape == (3, 4)
        assert torch.equal(got.double(), total.to(dtype).double())
        assert torch.equal(x, rank_tensor((3, 4), dtype, r)), "input modified"
        assert torch.equal(hvd.allreduce(x, op=hvd.Max, name=f"max.{label}").double(),
                           inputs[-1])
        pointer = x.data_ptr()
        same = hvd.allreduce_(x, op=hvd.Sum, name=f"inplace.{label}")
        assert same is x and x.data_ptr() == pointer
        assert torch.equal(x.double(), total.to(dtype).double())


@mpi_test()
def test_average_default_and_deprecated_average_flag():
    r, n = hvd.rank(), hvd.size()
    x = torch.full((4,), float(r))
    mean = sum(range(n)) / n
    assert torch.allclose(hvd.allreduce(x), torch.full((4,), mean))
    assert torch.allclose(hvd.allreduce(x, average=True), torch.full((4,), mean))
    assert torch.allclose(hvd.allreduce(x, average=False), torch.full((4,), float(sum(range(n)))))
    got = hvd.allreduce(x + 1, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert torch.allclose(got, torch.full((4,), 0.5 * sum(k + 1 for k in range(n))))


@mpi_test()
def test_a_view_of_a_dropped_result_keeps_its_values_through_later_calls():
    x = torch.full((200_000,), hvd.rank() + 1.0)
    want = sum(range(1, hvd.size() + 1))
    view = hvd.allreduce(x, op=hvd.Sum, name="kept")[5:10]   # the result itself dropped
    for step in range(3):
        later = hvd.allreduce(x * (step + 2), op=hvd.Sum, name="kept")
        assert torch.equal(later, torch.full_like(x, want * (step + 2)))
    assert torch.equal(view, torch.full((5,), float(want)))


@mpi_test()
def test_async_poll_synchronize_and_reverse_submission_order():
    r, n = hvd.rank(), hvd.size()
    order = range(10) if r % 2 == 0 else reversed(range(10))
    handles = {i: hvd.allreduce_async(torch.full((i + 1,), float(r + i)), name=f"async.{i}",
                                      op=hvd.Sum) for i in order}
    while not all(hvd.poll(h) for h in handles.values()):
        pass
    for i, handle in handles.items():
        assert torch.equal(hvd.synchronize(handle),
                           torch.full((i + 1,), float(sum(k + i for k in range(n)))))
    y = torch.ones(3)
    handle = hvd.allreduce_async_(y, name="async.inplace", op=hvd.Sum)
    assert hvd.synchronize(handle) is y and torch.equal(y, torch.full((3,), float(n)))


@mpi_test()
def test_noncontiguous_and_grad_requiring_tensors():
    r, n = hvd.rank(), hvd.size()
    base = torch.arange(24.0).reshape(4, 6) + r
    view = base[::2, 1::2]
    assert not view.is_contiguous()
    want = sum(torch.arange(24.0).reshape(4, 6)[::2, 1::2] + k for k in range(n))
    assert torch.equal(hvd.allreduce(view, op=hvd.Sum), want)
    hvd.allreduce_(view, op=hvd.Sum, name="strided.inplace")
    assert torch.equal(base[::2, 1::2], want)
    assert torch.equal(base[1::2], torch.arange(24.0).reshape(4, 6)[1::2] + r)
    leaf = torch.full((2,), float(r), requires_grad=True)
    hvd.broadcast_(leaf, root_rank=0, name="leaf")
    assert torch.equal(leaf.detach(), torch.zeros(2)) and leaf.requires_grad


@mpi_test()
def test_grouped_allreduce_forms():
    r, n = hvd.rank(), hvd.size()
    tensors = [torch.full((k + 1,), float(r + k)) for k in range(4)]
    want = [torch.full((k + 1,), float(sum(j + k for j in range(n)))) for k in range(4)]
    for got, expected in zip(hvd.grouped_allreduce(tensors, op=hvd.Sum), want):
        assert torch.equal(got, expected)
    got = hvd.synchronize(hvd.grouped_allreduce_async(tensors, op=hvd.Sum, name="g.async"))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    copies = [t.clone() for t in tensors]
    same = hvd.synchronize(hvd.grouped_allreduce_async_(copies, op=hvd.Sum, name="g.in"))
    assert all(s is c and torch.equal(c, w) for s, c, w in zip(same, copies, want))
    result = hvd.grouped_allreduce_(tensors, op=hvd.Sum)
    assert all(s is t and torch.equal(t, w) for s, t, w in zip(result, tensors, want))


@mpi_test()
def test_allgather_broadcast_alltoall_reducescatter():
    r, n = hvd.rank(), hvd.size()
    gathered = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.bfloat16))
    assert gathered.dtype == torch.bfloat16
    assert torch.equal(gathered, torch.cat([torch.full((k + 1, 2), k, dtype=torch.bfloat16)
                                            for k in range(n)]))
    a, b = hvd.grouped_allgather([torch.full((1,), r), torch.full((2, 1), 10.0 * r)])
    assert a.tolist() == list(range(n)) and b.shape == (2 * n, 1)
    x = torch.full((2, 3), float(r))
    assert torch.equal(hvd.broadcast(x, root_rank=n - 1), torch.full((2, 3), n - 1.0))
    assert torch.equal(x, torch.full((2, 3), float(r)))
    assert hvd.broadcast_(x, root_rank=1) is x and torch.equal(x, torch.ones(2, 3))
    # alltoall: rank r sends k + 1 rows holding r to rank k
    splits = torch.tensor([k + 1 for k in range(n)], dtype=torch.int32)
    rows = torch.full((int(splits.sum()), 2), r, dtype=torch.int16)
    output, received = hvd.alltoall(rows, splits=splits)
    assert received.tolist() == [r + 1] * n and received.dtype == torch.int32
    assert torch.equal(output[:, 0], torch.arange(n, dtype=torch.int16).repeat_interleave(r + 1))
    equal = hvd.alltoall(torch.arange(2 * n) + 100 * r)
    assert equal.tolist() == [100 * k + 2 * r + j for k in range(n) for j in range(2)]
    # reducescatter: n + 1 rows, rank 0 gets the extra one
    scattered = hvd.reducescatter(torch.ones(n + 1, 2) * (r + 1), op=hvd.Sum)
    assert scattered.shape == ((2 if r == 0 else 1), 2)
    assert torch.all(scattered == sum(k + 1 for k in range(n)))
    parts = hvd.grouped_reducescatter([torch.ones(n, 1), torch.full((2 * n,), float(r))])
    assert torch.equal(parts[0], torch.ones(1, 1))
    assert torch.allclose(parts[1], torch.full((2,), sum(range(n)) / n))


@mpi_test()
def test_sparse_allreduce_sums_entries_of_every_rank():
    r, n = hvd.rank(), hvd.size()
    indices = torch.tensor([[r, n]])                   # rows r and n of a (n + 1, 2) matrix
    values = torch.full((2, 2), float(r + 1))
    sparse = torch.sparse_coo_tensor(indices, values, (n + 1, 2))
    handle = hvd.sparse_allreduce_async(sparse, name="sparse", op=hvd.Sum)
    total = handle().to_dense()
    want = torch.zeros(n + 1, 2)
    for k in range(n):
        want[k] += k + 1
        want[n] += k + 1
    assert torch.equal(total, want)
    mean = hvd.synchronize(hvd.sparse_allreduce_async(sparse, name="sparse.avg", op=hvd.Average))
    assert torch.allclose(mean.to_dense(), want / n)


@mpi_test()
def test_mismatched_shape_and_dtype_raise_on_every_rank_with_the_name():
    r = hvd.rank()
    message = raises_everywhere(hvd.MismatchError, "mismatch",
                                lambda: hvd.allreduce(torch.zeros(3 + r), name="layer.w"))
    assert "'layer.w'" in message and "rank 0: (3,)" in message
    dtype = torch.float32 if r == 0 else torch.float64
    message = raises_everywhere(hvd.HorovodInternalError, "mismatch",
                                lambda: hvd.allgather(torch.zeros(2, dtype=dtype), name="gd"))
    assert "'gd'" in message and "float32" in message and "float64" in message
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after"),
                       torch.full((2,), float(hvd.size())))


@mpi_test()
def test_unsupported_dtypes_and_devices_give_clear_errors():
    message = raises_everywhere(TypeError, "unsupported dtype bool",
                                lambda: hvd.allreduce(torch.zeros(2, dtype=torch.bool),
                                                      name="flags"))
    assert "'flags'" in message
    with pytest.raises(TypeError, match="cuda_built\\(\\) is False.*cpu\\(\\)"):
        hvd.allreduce_async(torch.zeros(2, device="meta"))
    with pytest.raises(TypeError, match="unsupported dtype torch.complex32"):
        hvd.allreduce_async(torch.zeros(2, dtype=torch.complex32))
    with pytest.raises(TypeError, match="sparse_allreduce_async"):
        hvd.allreduce_async(torch.zeros(2).to_sparse())
    # the other ranks submit late, so rank 0's first 'twice' is surely in flight
    if hvd.rank() != 0:
        time.sleep(0.2)
    handle = hvd.allreduce_async(torch.ones(1), name="twice")
    if hvd.rank() == 0:
        with pytest.raises(ValueError, match="'twice' is already in flight"):
            hvd.allreduce_async(torch.ones(1), name="twice")
    hvd.synchronize(handle)


@mpi_test()
def test_join_and_barrier():
    r, n = hvd.rank(), hvd.size()
    if r != 0:
        # completes only once rank 0 has joined: it contributes zeros
        got = hvd.allreduce(torch.ones(2) * r, op=hvd.Sum, name="while.joined")
        assert torch.equal(got, torch.full((2,), float(sum(range(1, n)))))
    last = hvd.join()
    assert last != 0 and hvd.allgather_object(last) == [last] * n
    hvd.barrier()
