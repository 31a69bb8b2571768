"""Gradients of the autograd-aware collectives, as Horovod defines them.

Every rank weighs the collective's output differently, so each expected
gradient shows where the backward pass gathered its parts from.
"""

import torch

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test

torch.set_num_threads(1)


def leaf(shape, value):
    return torch.full(shape, float(value), requires_grad=True)


@mpi_test()
def test_allreduce_gradient_is_the_same_allreduce_of_the_gradients():
    r, n = hvd.rank(), hvd.size()
    x = leaf((3,), r)
    (hvd.allreduce(x, op=hvd.Sum, name="ar.sum") * (r + 1)).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(sum(k + 1 for k in range(n)))))
    x = leaf((3,), r)
    y = hvd.allreduce(x, name="ar.avg", prescale_factor=2.0, postscale_factor=3.0)
    (y * (r + 1)).sum().backward()
    want = 6.0 * sum(k + 1 for k in range(n)) / n
    assert torch.allclose(x.grad, torch.full((3,), want))
    x = leaf((2,), r)
    y = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert y.dtype == torch.float32
    (y * (r + 1)).sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad, torch.full((2,), float(sum(k + 1 for k in range(n)))))


@mpi_test()
def test_grouped_allreduce_gradients():
    r, n = hvd.rank(), hvd.size()
    a, b = leaf((2,), r), leaf((1, 3), -r)
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="gar")
    (ya.sum() * (r + 1) + yb.sum() * 2 * (r + 1)).backward()
    total = float(sum(k + 1 for k in range(n)))
    assert torch.equal(a.grad, torch.full((2,), total))
    assert torch.equal(b.grad, torch.full((1, 3), 2 * total))


def gather_weights(rank, rows):
    """The weight rank ``rank`` puts on each row of an allgather result."""
    return (rank + 1) * torch.arange(rows, dtype=torch.float32).view(-1, 1).expand(rows, 2)


@mpi_test()
def test_allgather_gradient_is_the_averaged_gradient_at_this_ranks_rows():
    r, n = hvd.rank(), hvd.size()
    rows = sum(k + 1 for k in range(n))
    offset = sum(k + 1 for k in range(r))
    mean = sum(gather_weights(k, rows) for k in range(n)) / n
    x = leaf((r + 1, 2), r)
    (hvd.allgather(x, name="ag") * gather_weights(r, rows)).sum().backward()
    assert torch.allclose(x.grad, mean[offset:offset + r + 1])
    a, b = leaf((r + 1, 2), r), leaf((1, 2), r)
    ya, yb = hvd.grouped_allgather([a, b], name="gag")
    ((ya * gather_weights(r, rows)).sum() + (yb * gather_weights(r, n)).sum()).backward()
    assert torch.allclose(a.grad, mean[offset:offset + r + 1])
    assert torch.allclose(b.grad, (sum(gather_weights(k, n) for k in range(n)) / n)[r:r + 1])


@mpi_test()
def test_broadcast_gradient_goes_to_the_root_only():
    r, n = hvd.rank(), hvd.size()
    root = n - 1
    x = leaf((2, 2), r)
    y = hvd.broadcast(x, root_rank=root, name="bc")
    assert torch.equal(y.detach(), torch.full((2, 2), float(root)))
    (y * (r + 1)).sum().backward()
    want = sum(k + 1 for k in range(n)) / n if r == root else 0.0
    assert torch.allclose(x.grad, torch.full((2, 2), want))


@mpi_test()
def test_alltoall_gradient_sends_each_rows_gradient_back_to_its_sender():
    r, n = hvd.rank(), hvd.size()
    splits = [k + 1 for k in range(n)]              # rank r sends k + 1 rows to rank k
    x = torch.arange(sum(splits), dtype=torch.float64).view(-1, 1).requires_grad_()
    y, received = hvd.alltoall(x, splits=torch.tensor(splits), name="a2a")
    assert received.tolist() == [r + 1] * n
    weights = 1000.0 * r + torch.arange(y.shape[0], dtype=torch.float64).view(-1, 1)
    (y * weights).sum().backward()
    # the block x sent to rank k came back weighted by rank k's weights of our rows
    want = torch.cat([1000.0 * k + r * (k + 1) + torch.arange(k + 1, dtype=torch.float64)
                      for k in range(n)]).view(-1, 1)
    assert torch.equal(x.grad, want)
    x = leaf((2 * n, 1), r)
    y = hvd.alltoall(x)
    (y * (r + 1)).sum().backward()
    assert torch.equal(x.grad, torch.cat([torch.full((2, 1), k + 1.0) for k in range(n)]))


@mpi_test()
def test_reducescatter_gradient_gathers_the_gradients_and_scales_them():
    r, n = hvd.rank(), hvd.size()
    rows = [2 if k == 0 else 1 for k in range(n)]     # n + 1 rows: rank 0 gets two
    gathered = torch.cat([torch.full((rows[k], 2), k + 1.0) for k in range(n)])
    x = leaf((n + 1, 2), r)
    y = hvd.reducescatter(x, name="rs", prescale_factor=2.0, postscale_factor=0.5)
    assert y.shape == (rows[r], 2)
    (y * (r + 1)).sum().backward()
    assert torch.allclose(x.grad, gathered / n)
    a, b = leaf((n + 1, 2), r), leaf((n, 3), r)
    ya, yb = hvd.grouped_reducescatter([a, b], op=hvd.Sum, name="grs")
    ((ya * (r + 1)).sum() + (yb * 2 * (r + 1)).sum()).backward()
    assert torch.equal(a.grad, gathered)
    assert torch.equal(b.grad, 2 * torch.cat([torch.full((1, 3), k + 1.0) for k in range(n)]))
