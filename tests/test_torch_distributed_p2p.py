"""torch.distributed's send and recv over "mpitrain", on MPI: exact tensors, tags,
any source, any order, torch's batch_isend_irecv, subgroups, and the receiver's
error on a dtype or shape it does not expect.

The tensors received are compared with what the sender built from the same
seed (torch.equal: bitwise).
"""

import datetime
import time

import torch
import torch.distributed as dist

from tests.mpi_harness import mpi_test
from tests.torch_distributed_groups import mpitrain_group

torch.set_num_threads(1)

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
          torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64)


def made(shape, dtype, seed):
    """What a sender sends: seeded values, the same on every rank."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    return values.to(dtype) if not dtype.is_complex else torch.complex(values, -values).to(dtype)


def ring():
    mpitrain_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    return rank, size, (rank + 1) % size, (rank - 1) % size


@mpi_test(np=(2, 3), timeout=180)
def test_send_recv_is_exact_for_each_dtype_and_shape():
    rank, size, right, left = ring()
    for seed, (dtype, shape) in enumerate([(d, s) for d in DTYPES
                                           for s in ((), (0,), (7,), (3, 5, 2))]):
        outgoing = dist.isend(made(shape, dtype, 1000 * rank + seed), right, tag=seed)
        received = torch.empty(shape, dtype=dtype)
        dist.recv(received, left, tag=seed)
        outgoing.wait()
        assert torch.equal(received, made(shape, dtype, 1000 * left + seed)), (dtype, shape)


@mpi_test(np=(2, 3), timeout=180)
def test_large_and_non_contiguous_tensors_arrive_exactly():
    rank, size, right, left = ring()
    works = [dist.isend(made((9 << 20,), torch.float64, rank), right),       # 72 MiB
             dist.isend(made((6, 40), torch.float32, rank).t()[::2], right, tag=1)]
    big = torch.empty(9 << 20, dtype=torch.float64)
    dist.recv(big, left)
    whole = torch.full((20, 12), -1.0)
    dist.recv(whole[:, ::2], left, tag=1)           # every other column: strided
    for work in works:
        work.wait()
    assert torch.equal(big, made((9 << 20,), torch.float64, left))
    assert torch.equal(whole[:, ::2], made((6, 40), torch.float32, left).t()[::2])
    assert torch.equal(whole[:, 1::2], torch.full((20, 6), -1.0))


@mpi_test(np=(2, 3), timeout=180)
def test_a_message_over_two_gib_arrives_exactly():
    """MPI counts stop at 2**31 - 1: it travels in pieces (rank 0 to rank 1 only)."""
    rank = dist.get_rank()
    rows, pattern = (1 << 23) + 1, torch.arange(256, dtype=torch.uint8)   # 2 GiB + 256 B
    if rank == 0:
        dist.send(pattern.repeat(rows), 1, tag=2)
    elif rank == 1:
        received = torch.zeros(rows * 256, dtype=torch.uint8)
        dist.recv(received, 0, tag=2)
        for block in received.view(rows, 256).split(1 << 20):
            assert torch.equal(block, pattern.expand_as(block))
        del received
    dist.barrier()


@mpi_test(np=(2, 3), timeout=180)
def test_tags_are_kept_apart_and_one_tag_keeps_its_order():
    rank, size, right, left = ring()
    big = 3 << 20                                   # 12 MiB: MPI's rendezvous, not eager
    works = [dist.isend(made((big,), torch.float32, 10 * rank + tag), right, tag=tag)
             for tag in (1, 2, 1)]
    second_tag = torch.empty(big)
    dist.recv(second_tag, left, tag=2)              # listed second, received first
    firsts = [torch.empty(big), torch.empty(big)]
    for into in firsts:
        dist.recv(into, left, tag=1)
    for work in works:
        work.wait()
    assert torch.equal(second_tag, made((big,), torch.float32, 10 * left + 2))
    assert all(torch.equal(into, made((big,), torch.float32, 10 * left + 1)) for into in firsts)


@mpi_test(np=(2, 3), timeout=180)
def test_recv_from_any_source_names_the_sender():
    rank, size, _, _ = ring()
    for tag in (0, 4):
        if rank == 0:
            senders = []
            for _ in range(size - 1):
                into = torch.empty(5, dtype=torch.int64)
                sender = dist.recv(into, tag=tag)
                assert torch.equal(into, made(5, torch.int64, sender)), sender
                senders.append(sender)
            assert sorted(senders) == list(range(1, size))
        else:
            dist.send(made(5, torch.int64, rank), 0, tag=tag)
    dist.barrier()


@mpi_test(np=(2, 3), timeout=180)
def test_isend_and_irecv_pair_up_in_any_order():
    rank, size, right, left = ring()
    shape = (2 << 20,)                                  # 8 MiB each
    for receive_first in (True, False):
        receives = [torch.empty(shape) for _ in range(3)]
        if receive_first:
            incoming = [dist.irecv(into, left, tag=tag) for tag, into in enumerate(receives)]
        outgoing = [dist.isend(made(shape, torch.float32, 10 * rank + tag), right, tag=tag)
                    for tag in (2, 0, 1)]
        if not receive_first:
            incoming = [dist.irecv(into, left, tag=tag) for tag, into in enumerate(receives)]
        for work in reversed(incoming + outgoing):
            work.wait()
            assert work.is_completed() and work.get_future().done()
        for tag, into in enumerate(receives):
            assert torch.equal(into, made(shape, torch.float32, 10 * left + tag))
    future = dist.irecv(into := torch.empty(3), left, tag=9).get_future()
    dist.isend(made(3, torch.float32, rank), right, tag=9).wait()
    assert torch.equal(future.wait()[0], made(3, torch.float32, left))
    assert future.value()[0] is into


@mpi_test(np=(2, 3), timeout=180)
def test_torch_docs_batch_isend_irecv_ring():
    rank, world_size, _, _ = ring()
    for length in (2, 16 << 20):                       # torch's example, then 64 MiB
        send_tensor = torch.arange(length, dtype=torch.float32) + 2 * rank
        recv_tensor = torch.randn(length, dtype=torch.float32)
        send_op = dist.P2POp(dist.isend, send_tensor, (rank + 1) % world_size)
        recv_op = dist.P2POp(dist.irecv, recv_tensor, (rank - 1 + world_size) % world_size)
        reqs = dist.batch_isend_irecv([send_op, recv_op])
        for req in reqs:
            req.wait()
        left = (rank - 1) % world_size
        assert torch.equal(recv_tensor, torch.arange(length, dtype=torch.float32) + 2 * left)


@mpi_test(np=(3, 4), timeout=180)
def test_send_recv_in_a_subgroup_of_three_ranks_counts_job_ranks():
    rank, size, _, _ = ring()
    members = list(range(size - 3, size))            # on 4 ranks: 1, 2, 3 (group ranks 0-2)
    subgroup = dist.new_group(members)
    if rank not in members:
        dist.barrier()
        return
    right = members[(members.index(rank) + 1) % 3]
    left = members[(members.index(rank) - 1) % 3]
    outgoing = dist.isend(made((4, 4), torch.float64, rank), right, group=subgroup)
    received = torch.empty(4, 4, dtype=torch.float64)
    dist.recv(received, left, group=subgroup)
    outgoing.wait()
    assert torch.equal(received, made((4, 4), torch.float64, left))
    first = members[0]
    if rank == first:
        into = torch.empty(2)
        senders = {dist.recv(into, group=subgroup, tag=3) for _ in range(2)}
        assert senders == set(members[1:])                 # job ranks, as torch returns them
    else:
        dist.send(torch.ones(2), first, group=subgroup, tag=3)
    dist.barrier()


@mpi_test(np=(2, 3), timeout=180)
def test_a_recv_of_another_dtype_or_shape_raises_and_the_send_completes():
    rank, size, right, left = ring()
    sent = made((2 << 20,), torch.float32, rank)          # 8 MiB: the sender waits for it
    for tag, into in ((5, torch.empty(2 << 20, dtype=torch.int32)),
                      (6, torch.empty(1 << 20, 2))):
        outgoing = dist.isend(sent, right, tag=tag)
        try:
            dist.recv(into, left, tag=tag)
        except ValueError as error:
            message = str(error)
        else:
            raise AssertionError("a recv of another dtype or shape did not raise")
        assert message == (f"dist.recv from rank {left} with tag {tag}: rank {left} sent "
                           f"torch.float32 of shape ({2 << 20},), this rank receives into "
                           f"{into.dtype} of shape {tuple(into.shape)}")
        outgoing.wait()                                   # drained by the receiver
        assert outgoing.is_completed() and outgoing.exception() is None
    outgoing = dist.isend(sent, right, tag=5)             # the same tag still works
    received = torch.empty(2 << 20)
    dist.recv(received, left, tag=5)
    outgoing.wait()
    assert torch.equal(received, made((2 << 20,), torch.float32, left))


@mpi_test(np=(2, 3), timeout=180)
def test_an_isend_moves_while_its_sender_does_not_wait():
    rank, size, right, left = ring()
    pause = 5.0
    if rank == 0:
        outgoing = dist.isend(made((16 << 20,), torch.float32, 0), 1)        # 64 MiB
        time.sleep(pause)                                  # no MPI call of this thread
        assert outgoing.is_completed() and outgoing.get_future().done()
        outgoing.wait()
    elif rank == 1:
        started = time.monotonic()
        received = torch.empty(16 << 20)
        dist.recv(received, 0)
        assert time.monotonic() - started < pause / 2
        assert torch.equal(received, made((16 << 20,), torch.float32, 0))
    dist.barrier()


@mpi_test(np=(2, 3), timeout=180)
def test_a_recv_with_nothing_sent_times_out_and_a_later_message_still_arrives():
    rank, size, right, left = ring()
    quick = dist.new_group(backend="mpitrain", timeout=datetime.timedelta(seconds=2))
    started = time.monotonic()
    try:
        dist.recv(torch.empty(3), left, group=quick, tag=9)
    except TimeoutError as error:
        assert str(error) == f"dist.recv from rank {left} with tag 9: nothing arrived " \
                             "within its timeout of 2 s"
    else:
        raise AssertionError("a recv of nothing did not time out")
    assert 2 <= time.monotonic() - started < 20
    dist.barrier()
    dist.send(made(3, torch.float32, rank), right, group=quick, tag=9)
    received = torch.empty(3)
    dist.recv(received, left, group=quick, tag=9)
    assert torch.equal(received, made(3, torch.float32, left))
