"""A rank that stops submitting: a warning that names it, then a clean stop."""

import logging
import time

import numpy as np
import pytest

import mpitrain as mt
from tests.mpi_harness import mpi_test

FAST_STALL = {"MPITRAIN_STALL_CHECK_TIME_SECONDS": "1",
              "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "3"}


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []
        self.times = []             # when each was logged, as time.time()

    def emit(self, record):
        self.messages.append(record.getMessage())
        self.times.append(record.created)


def wait_for_stall_shutdown(name, warm_up_steps):
    records = Records()
    logging.getLogger("mpitrain").addHandler(records)
    mt.init()
    r = mt.rank()
    for _ in range(warm_up_steps):
        mt.allreduce(np.ones(2), name=name)
    started = time.monotonic()
    if r == 0:
        with pytest.raises(mt.ShutdownError) as caught:
            mt.allreduce(np.ones(2), name=name)
        report = str(caught.value)
        assert f"'{name}'" in report and "rank 1" in report and "stall" in report
        assert any(f"'{name}'" in m and "rank 1" in m for m in records.messages), \
            records.messages
    else:
        while mt.is_initialized():               # rank 1 "forgets" the tensor
            time.sleep(0.05)
        with pytest.raises(mt.ShutdownError, match=name):
            mt.allreduce(np.ones(2), name="too.late")
    elapsed = time.monotonic() - started
    assert 3 <= elapsed < 10, elapsed
    mt.shutdown()
    logging.getLogger("mpitrain").removeHandler(records)


@mpi_test(env=FAST_STALL, init=False)
def test_a_new_tensor_one_rank_never_submits():
    wait_for_stall_shutdown("forgotten", warm_up_steps=0)


@mpi_test(env=FAST_STALL, init=False)
def test_a_cached_tensor_one_rank_stops_submitting():
    wait_for_stall_shutdown("stopped.submitting", warm_up_steps=5)


@mpi_test(env={"MPITRAIN_STALL_CHECK_TIME_SECONDS": "0.5",
               "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "0"})
def test_shutdown_time_zero_only_warns():
    if mt.rank() == 1:
        time.sleep(2.0)
    assert mt.allreduce(np.ones(1), op=mt.Sum, name="slow.rank")[0] == mt.size()


@mpi_test(np=(3,), env=FAST_STALL, init=False)
def test_a_stall_in_a_set_without_rank_0_is_reported_by_its_coordinator():
    records = Records()
    logging.getLogger("mpitrain").addHandler(records)
    pair = mt.ProcessSet([1, 2])
    mt.init(process_sets=[pair])
    if mt.rank() == 1:                       # the pair's coordinator
        with pytest.raises(mt.ShutdownError, match="'in.the.pair'"):
            mt.allreduce(np.ones(2), name="in.the.pair", process_set=pair)
        assert any("'in.the.pair'" in m and "rank 2" in m
                   and "on process set 1 (ranks [1, 2])" in m for m in records.messages), \
            records.messages
    else:
        while mt.is_initialized():
            time.sleep(0.05)
    mt.shutdown()
    logging.getLogger("mpitrain").removeHandler(records)


@mpi_test(np=(3,), env={"MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "1.2",
                        "MPITRAIN_CHUNK_SIZE": str(256 * 1024),
                        "MPITRAIN_INTRA_NODE": "mpi"}, timeout=60)
def test_a_long_healthy_transfer_is_not_taken_for_a_frozen_rank():
    """512 MiB in 256 KiB MPI calls takes seconds here, longer than the
    shutdown time: on the job-wide set, on a process set, and for the rank
    that waits for the set's members meanwhile. (Through shared memory the
    job-wide part would be too quick to show anything.)"""
    n = mt.size()
    x = np.full(1 << 27, 1.0, np.float32)
    pair = mt.add_process_set([0, 1])
    try:
        started = time.monotonic()
        assert mt.allreduce(x, op=mt.Sum, name="long.everyone")[-1] == n
        if pair.included():
            assert mt.allreduce(x, op=mt.Sum, name="long.pair", process_set=pair)[-1] == 2
        mt.barrier()
        assert time.monotonic() - started > 1.2, "too fast to show anything here"
    finally:
        mt.remove_process_set(pair)
