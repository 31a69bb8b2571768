"""The cycle time: a value out of range fails init() on every rank, and no
pause between rounds, whatever the cycle time, outlasts the stall check."""

import logging
import os
import time

import numpy as np
import pytest

import mpitrain as mt
from tests.mpi_harness import mpi_test
from tests.test_stall import Records

FAST_STALL = {"MPITRAIN_STALL_CHECK_TIME_SECONDS": "1",
              "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "3"}


def refused(value):
    return (f"MPITRAIN_CYCLE_TIME={value!r} is not valid: it accepts a number of "
            "milliseconds >= 0 and <= 1000")


@mpi_test(env={"MPITRAIN_CYCLE_TIME": "1000000", **FAST_STALL}, init=False, timeout=20)
def test_a_cycle_time_out_of_range_fails_init_on_every_rank():
    from mpi4py import MPI
    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    with pytest.raises(ValueError) as caught:
        mt.init()
        # init() took it, and this never returned, nor came the stall shutdown
        mt.allreduce(np.ones(3), name="three.floats")
    everyone = ", ".join(map(str, range(size)))
    assert str(caught.value) == f"init() failed on ranks {everyone}: {refused('1000000')}"
    os.environ["MPITRAIN_CYCLE_TIME"] = "1e12" if rank == 1 else "1"
    try:
        with pytest.raises(ValueError) as caught:
            mt.init()
        assert str(caught.value) == f"init() failed on rank 1: {refused('1e12')}"
        os.environ["MPITRAIN_CYCLE_TIME"] = "1000"          # the longest accepted
        mt.init()
        assert mt.allreduce(np.ones(3), op=mt.Sum).tolist() == [size] * 3
        mt.shutdown()
    finally:
        os.environ["MPITRAIN_CYCLE_TIME"] = "1000000"


@mpi_test(env={"MPITRAIN_CYCLE_TIME": "1000", "MPITRAIN_STALL_CHECK_TIME_SECONDS": "0.1",
               "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "0"})
def test_the_longest_cycle_time_does_not_hold_back_the_stall_check():
    records = Records()
    logging.getLogger("mpitrain").addHandler(records)
    submitted = time.time()
    if mt.rank() != 0:
        time.sleep(1.5)                           # rank 0's allreduce stalls
    got = mt.allreduce(np.ones(2), op=mt.Sum, name="late")
    logging.getLogger("mpitrain").removeHandler(records)
    assert got.tolist() == [mt.size()] * 2
    if mt.rank() == 0:
        # Rounds a cycle (1 s) apart warned after 1-2 s; a check time apart, 0.2-0.3 s.
        warned_after = [when - submitted for when in records.times]
        assert warned_after and warned_after[0] < 0.7, warned_after
