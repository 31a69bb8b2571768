"""The engine does not spin: idle ranks and waiting ranks leave the core alone."""

import resource
import time

import numpy as np

import mpitrain as mt
from tests.mpi_harness import mpi_test


def process_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def engine_cpu_seconds():
    thread = mt.api.basics.engine()._thread
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


@mpi_test(np=(2,), timeout=40)
def test_an_idle_rank_burns_under_two_percent_of_a_core():
    mt.allreduce(np.ones(10), name="warm.up")
    cpu, wall = process_cpu_seconds(), time.monotonic()
    time.sleep(10)
    share = (process_cpu_seconds() - cpu) / (time.monotonic() - wall)
    assert share < 0.02, f"idle process used {share:.1%} of a core"


@mpi_test(timeout=40)
def test_a_rank_waiting_for_its_peer_does_not_spin():
    mt.allreduce(np.ones(10), name="warm.up")
    if mt.rank() == 0:
        handle = mt.allreduce_async(np.ones(1000), name="late.peer")
        cpu, wall = engine_cpu_seconds(), time.monotonic()
        time.sleep(3)
        share = (engine_cpu_seconds() - cpu) / (time.monotonic() - wall)
        mt.synchronize(handle)
        assert share < 0.05, f"the waiting engine used {share:.1%} of a core"
    else:
        time.sleep(3.2)
        mt.allreduce(np.ones(1000), name="late.peer")
