"""torch.distributed's collectives over the "mpitrain" backend, against gloo's results and numpy.

Inputs hold small whole numbers, so sums are exact and the two backends must
agree bitwise whatever order they add in.
"""

import datetime
import os
import tempfile
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test
from tests.torch_distributed_groups import gloo_group, mpitrain_group

torch.set_num_threads(1)


def rank_tensor(shape=(3, 4), dtype=torch.float32, salt=0, rank=None):
    """Rank ``rank``'s (this rank's) input: whole numbers from -5 to 5."""
    rank = dist.get_rank() if rank is None else rank
    generator = torch.Generator().manual_seed(10 * rank + salt)
    return torch.randint(-5, 6, shape, generator=generator).to(dtype)


def both(run):
    """run(group) on mpitrain's group and on gloo's; returns the two results."""
    return run(mpitrain_group()), run(gloo_group())


def assert_equal(ours, gloos):
    if isinstance(ours, (list, tuple)):
        assert len(ours) == len(gloos)
        for a, b in zip(ours, gloos):
            assert_equal(a, b)
        return
    assert ours.dtype == gloos.dtype and torch.equal(ours, gloos), f"{ours}\n!=\n{gloos}"


@mpi_test(np=(2, 3), timeout=120)
def test_all_reduce_with_each_op_matches_gloo():
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
               dist.ReduceOp.PRODUCT):
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            def run(group):
                t = rank_tensor(dtype=dtype)
                dist.all_reduce(t, op=op, group=group)
                return t
            assert_equal(*both(run))


@mpi_test(np=(2, 3), timeout=120)
def test_avg_and_premul_sum_against_numpy():
    inputs = [None] * dist.get_world_size()
    dist.all_gather_object(inputs, rank_tensor(salt=1).numpy())
    t = rank_tensor(salt=1)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    np.testing.assert_allclose(t.numpy(), np.mean(inputs, axis=0), rtol=1e-6)
    t = rank_tensor(salt=1)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    np.testing.assert_array_equal(t.numpy(), np.sum(inputs, axis=0) * 0.5)


@mpi_test(np=(2, 3), timeout=120)
def test_async_work_waits_completes_and_has_a_future():
    t = rank_tensor(shape=(1000,))
    expected = rank_tensor(shape=(1000,))
    dist.all_reduce(expected, group=gloo_group())
    work = dist.all_reduce(t, async_op=True)
    future = work.get_future()
    assert work.wait()
    assert work.is_completed() and future.done()
    assert torch.equal(future.value()[0], expected) and torch.equal(t, expected)
    chained = dist.all_reduce(rank_tensor(shape=(5,)), async_op=True).get_future().then(
        lambda f: f.value()[0] * 2)
    reference = rank_tensor(shape=(5,))
    dist.all_reduce(reference, group=gloo_group())
    assert torch.equal(chained.wait(), reference * 2)


@mpi_test(np=(2, 3), timeout=120)
def test_calls_from_callbacks_pair_up_while_the_user_makes_others():
    """A future's callback makes all_reduces (as DDP's PowerSGD hook does) while
    the user's thread makes its own, in another interleaving on each rank: each
    call still meets the other ranks' same call."""
    rank, size = dist.get_rank(), dist.get_world_size()
    expected = sum(range(size))

    def callback(future):
        time.sleep(0.02 * rank)
        inner = [torch.full((4,), float(rank + 100 * i)) for i in range(3)]
        for t in inner:
            dist.all_reduce(t)
        return inner
    chained = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(callback)
    time.sleep(0.02 * (size - rank))
    outer = [torch.full((4,), float(rank - 100 * i)) for i in range(5)]
    for t in outer:
        dist.all_reduce(t)
    for i, t in enumerate(chained.wait()):
        assert torch.equal(t, torch.full((4,), float(expected + 100 * i * size))), (i, t)
    for i, t in enumerate(outer):
        assert torch.equal(t, torch.full((4,), float(expected - 100 * i * size))), (i, t)


@mpi_test(np=(2, 3), timeout=120)
def test_coalesced_all_reduce_broadcast_and_reduce_match_gloo():
    def coalesced(group):
        tensors = [rank_tensor(salt=s) for s in range(3)]
        dist.all_reduce_coalesced(tensors, group=group)
        return tensors
    assert_equal(*both(coalesced))
    for root in range(dist.get_world_size()):
        def broadcast(group):
            t = rank_tensor(dtype=torch.int32)
            dist.broadcast(t, root, group=group)
            return t

        def reduce(group):
            t = rank_tensor()
            dist.reduce(t, root, op=dist.ReduceOp.MAX, group=group)
            return t
        assert_equal(*both(broadcast))
        ours, gloos = both(reduce)
        if dist.get_rank() == root:             # elsewhere gloo leaves partial results
            assert_equal(ours, gloos)


@mpi_test(np=(2, 3), timeout=120)
def test_gathers_and_scatters_match_gloo():
    size, rank = dist.get_world_size(), dist.get_rank()

    def all_gather(group):
        outputs = [torch.empty(3, 4) for _ in range(size)]
        dist.all_gather(outputs, rank_tensor(), group=group)
        return outputs

    def all_gather_into_tensor(group):
        output = torch.empty(size * 3, 4, dtype=torch.float64)
        dist.all_gather_into_tensor(output, rank_tensor(dtype=torch.float64), group=group)
        return output

    def reduce_scatter(group):
        output = torch.empty(3, 4)
        dist.reduce_scatter(output, [rank_tensor(salt=r) for r in range(size)], group=group)
        return output

    def reduce_scatter_tensor(group, op=dist.ReduceOp.SUM):
        output = torch.empty(2, 5)
        dist.reduce_scatter_tensor(output, rank_tensor(shape=(2 * size, 5)), op=op,
                                   group=group)
        return output

    def gather(group):
        outputs = [torch.empty(3, 4) for _ in range(size)] if rank == 0 else None
        dist.gather(rank_tensor(), outputs, dst=0, group=group)
        return outputs or []

    def scatter(group):
        output = torch.empty(3, 4)
        inputs = [rank_tensor(salt=r) for r in range(size)] if rank == size - 1 else None
        dist.scatter(output, inputs, src=size - 1, group=group)
        return output

    for run in (all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor,
                gather, scatter):
        assert_equal(*both(run))
    ours = reduce_scatter_tensor(mpitrain_group(), dist.ReduceOp.MAX)
    assert_equal(ours, reduce_scatter_tensor(gloo_group(), dist.ReduceOp.MAX))


@mpi_test(np=(2, 3), timeout=120)
def test_all_to_all_with_and_without_splits_matches_gloo():
    size, rank = dist.get_world_size(), dist.get_rank()

    def all_to_all(group):
        outputs = [torch.empty(3, 2) for r in range(size)]
        dist.all_to_all(outputs, [rank_tensor((3, 2), salt=r) for r in range(size)],
                        group=group)
        return outputs

    def single_equal(group):
        output = torch.empty(2 * size, 3)
        dist.all_to_all_single(output, rank_tensor(shape=(2 * size, 3)), group=group)
        return output

    def single_splits(group):
        sent = [(rank + r) % 3 + 1 for r in range(size)]         # rows to rank r
        received = [(r + rank) % 3 + 1 for r in range(size)]     # rows from rank r
        output = torch.empty(sum(received), 2)
        dist.all_to_all_single(output, rank_tensor(shape=(sum(sent), 2)),
                               output_split_sizes=received, input_split_sizes=sent,
                               group=group)
        return output

    for run in (all_to_all, single_equal, single_splits):
        assert_equal(*both(run))
    # gloo's all_to_all takes tensors of one size only
    outputs = [torch.empty(r + 1, 2) for r in range(size)]
    dist.all_to_all(outputs, [rank_tensor((rank + 1, 2), salt=r) for r in range(size)])
    assert_equal(outputs, [rank_tensor((r + 1, 2), salt=rank, rank=r) for r in range(size)])


@mpi_test(np=(2, 3), timeout=120)
def test_barrier_send_recv_and_object_collectives():
    size, rank = dist.get_world_size(), dist.get_rank()
    dist.barrier()
    mpitrain_group().monitored_barrier()
    right, left = (rank + 1) % size, (rank - 1) % size
    for tag in (7, 3):                              # received in another order than sent
        dist.send(torch.full((4,), float(10 * rank + tag)), right, tag=tag)
    for tag in (3, 7):
        received = torch.empty(4)
        dist.recv(received, left, tag=tag)
        assert torch.equal(received, torch.full((4,), float(10 * left + tag)))
    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank, "list": list(range(rank))})
    assert objects == [{"rank": r, "list": list(range(r))} for r in range(size)]
    sent = [f"from {rank}", {"x": rank}]
    dist.broadcast_object_list(sent, src=1)
    assert sent == ["from 1", {"x": 1}]
    out = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(size)] if rank == 0 else None,
                             src=0)
    assert out == [f"to {rank}"]


@mpi_test(np=(2, 3), timeout=120)
def test_batch_isend_irecv_ring_and_every_pair_with_tags():
    size, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    received = torch.empty(3, 4)                    # torch's docs' ring: recv listed first
    for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, left),
                                           dist.P2POp(dist.isend, rank_tensor(), right)]):
        request.wait()
    assert_equal(received, rank_tensor(rank=left))
    peers = [peer for peer in range(size) if peer != rank]
    received = {(peer, tag): torch.full((2, peer + 1), -1.0) for peer in peers for tag in (5, 2)}
    operations = []
    for peer in peers:                              # each rank lists its ops in its own order
        receives = [dist.P2POp(dist.irecv, received[peer, tag], peer, tag=tag) for tag in (5, 2)]
        sends = [dist.P2POp(dist.isend, rank_tensor((2, rank + 1), salt=tag), peer, tag=tag)
                 for tag in (2, 5)]
        operations += receives + sends if rank % 2 else sends[::-1] + receives
    for request in dist.batch_isend_irecv(operations):
        request.wait()
    for (peer, tag), tensor in received.items():
        assert_equal(tensor, rank_tensor((2, peer + 1), salt=tag, rank=peer))


@mpi_test(np=(3,), timeout=120)
def test_new_group_is_a_process_set_of_its_ranks():
    rank = dist.get_rank()
    pair = dist.new_group([0, 2])
    if rank == 1:
        assert pair == dist.GroupMember.NON_GROUP_MEMBER
        return
    assert pair.process_set.ranks == [0, 2] and dist.get_backend(pair) == "mpitrain"
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=pair)
    assert torch.equal(t, torch.full((3,), 4.0))
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=2, group=pair)                  # a job rank, as torch counts
    assert torch.equal(b, torch.full((2,), 2.0))


@mpi_test(np=(2, 3), timeout=120)
def test_init_with_an_explicit_store_rank_and_size():
    """The last test of the job: it replaces the default group."""
    dist.destroy_process_group()
    gloo_group.cache_clear()
    path = os.path.join(tempfile.gettempdir(), f"mpitrain-torch-store-{os.getppid()}")
    store = dist.FileStore(path, hvd.size())
    with pytest.raises(ValueError, match="MPI gives this process rank"):
        dist.init_process_group("mpitrain", store=store, rank=(hvd.rank() + 1) % hvd.size(),
                                world_size=hvd.size())
    dist.init_process_group("mpitrain", store=store, rank=hvd.rank(), world_size=hvd.size(),
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(hvd.size())))
    dist.destroy_process_group()
