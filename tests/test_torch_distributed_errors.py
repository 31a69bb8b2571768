"""Bad input to torch.distributed over "mpitrain": an error on every rank, naming the
call, the ranks and what differed, and no hang (gloo would wait out its
timeout, 30 minutes by default, and NCCL its watchdog's).

Each case runs on a group of its own (dist.new_group), since a group whose
call failed refuses every later call. The stall cases stop mpitrain's engine
(the stall shutdown ends the job's collectives), so they start it again.
"""

import time

import pytest
import torch
import torch.distributed as dist

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test, run_mpi
from tests.torch_distributed_groups import mpitrain_group

A_RANK_RAISES = """
import torch, torch.distributed as dist
import mpitrain.torch
dist.init_process_group("mpitrain")
if dist.get_rank() == 1:
    raise ValueError("rank 1 broke")
dist.all_reduce(torch.ones(2))
"""

FAST_STALL = {"MPITRAIN_STALL_CHECK_TIME_SECONDS": "1",
              "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "3"}


def fresh_group():
    """A new group of every rank (mpitrain restarted if a stall stopped it)."""
    hvd.init()
    mpitrain_group()
    return dist.new_group(backend="mpitrain")


def fails_everywhere(call, *fragments):
    """``call()`` raises on this rank, with every fragment in the message."""
    with pytest.raises(Exception) as caught:
        call()
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


@mpi_test(np=(2, 3), env=FAST_STALL, init=False, timeout=120)
def test_all_reduce_of_another_shape_on_one_rank():
    group = fresh_group()
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(2), group=group)          # call 0 pairs up
    shape = (5,) if rank == 1 else (4,)
    fails_everywhere(lambda: dist.all_reduce(torch.ones(shape), group=group),
                     "call 1", "shapes", "rank 1: (5,)", "0", "(4,)")
    fails_everywhere(lambda: dist.all_reduce(torch.ones(4), group=group),
                     "an earlier call on this group failed", "shapes")


@mpi_test(np=(2, 3), env=FAST_STALL, init=False, timeout=120)
def test_another_op_dtype_or_root_on_one_rank():
    rank = dist.get_rank() if dist.is_initialized() else hvd.rank()
    for case in ("op", "dtype", "root"):
        group = fresh_group()
        odd = rank == 1
        if case == "op":
            op = dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM
            call = lambda: dist.all_reduce(torch.ones(3), op=op, group=group)
            expected = ("reduction ops", "Max", "Sum")
        elif case == "dtype":
            dtype = torch.float64 if odd else torch.float32
            call = lambda: dist.all_reduce(torch.ones(3, dtype=dtype), group=group)
            expected = ("data types", "float64", "float32")
        else:
            call = lambda: dist.broadcast(torch.ones(3), src=int(odd), group=group)
            expected = ("root ranks",)
        fails_everywhere(call, "call 0", "rank 1", *expected)


@mpi_test(np=(2, 3), env=FAST_STALL, init=False, timeout=120)
def test_a_skipped_collective_fails_the_next_call_that_differs():
    """Rank 1 skips the second all_reduce; its barrier meets the others' all_reduce."""
    group = fresh_group()
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(3), group=group)
    if rank != 1:
        fails_everywhere(lambda: dist.all_reduce(torch.ones(3), group=group),
                         "call 1", "rank 1")
    else:
        fails_everywhere(lambda: dist.barrier(group=group), "call 1", "rank 1")


@mpi_test(np=(2, 3), env=FAST_STALL, init=False, timeout=120)
def test_a_rank_without_valid_input_fails_the_others_too():
    group = fresh_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    outputs = [torch.empty(2) for _ in range(size - (rank == 1))]   # one short on rank 1
    message = fails_everywhere(lambda: dist.all_gather(outputs, torch.ones(2), group=group),
                               "call 0", "dist.all_gather", "rank 1")
    assert "one per rank of the group" in message, message
    group = fresh_group()
    op = dist.ReduceOp.BAND if rank == 0 else dist.ReduceOp.SUM
    fails_everywhere(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=op,
                                             group=group), "BAND", "rank 0")


@mpi_test(np=(2, 3), env=FAST_STALL, init=False, timeout=120)
def test_a_collective_on_the_wrong_group_ends_in_the_stall_report():
    """Rank 1 calls all_reduce on another group of the same ranks: nothing pairs,
    and every rank fails at the stall shutdown (3 s here) naming what rank 1 misses."""
    right, wrong = fresh_group(), fresh_group()
    rank = dist.get_rank()
    started = time.monotonic()
    group = wrong if rank == 1 else right
    message = fails_everywhere(lambda: dist.all_reduce(torch.ones(2), group=group),
                               "stall", "rank 1")
    assert f"'torch.distributed group {right.group_name} call 0'" in message, message
    assert time.monotonic() - started < 15
    hvd.shutdown()


@mpi_test(np=(2, 3), env=FAST_STALL, init=False, timeout=120)
def test_a_rank_that_stops_calling_fails_the_others_within_the_stall_time():
    group = fresh_group()
    rank = dist.get_rank()
    started = time.monotonic()
    if rank == 1:
        while hvd.is_initialized():              # rank 1 never makes the call
            time.sleep(0.05)
    else:
        fails_everywhere(lambda: dist.all_reduce(torch.ones(2), group=group),
                         "stall", "rank 1", f"group {group.group_name} call 0")
    assert time.monotonic() - started < 15
    hvd.shutdown()


def test_a_rank_that_raises_ends_the_job_with_its_traceback():
    """torch's excepthook buffered the traceback, and mpitrain's abort came first:
    the job ended with MPI_ABORT's notice alone."""
    job = run_mpi(2, ["-c", A_RANK_RAISES], timeout=120)
    assert job.returncode not in (0, None), job.returncode
    assert "mpitrain: rank 1 of 2" in job.stderr, job.stderr[-3000:]
    assert "ValueError: rank 1 broke" in job.stderr, job.stderr[-3000:]

