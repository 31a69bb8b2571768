"""A rank that fails in any way ends the whole job, quickly and with a reason.

Each test runs tests/scripts/rank_fails.py under mpirun: the last rank fails
at step 5 while the others wait for it in an allreduce or compute without
MPI. The job must end on its own (the harness kills it after 60 s), with a
non-zero exit code, an explanation naming the rank, and no process left.
Run with -s to see the measured time from the failure to the job's end.
"""

import os
import re
import tempfile
import time

import pytest

from mpitrain.runtime import config
from tests.mpi_harness import run_mpi

DEADLINE = 30.0                    # seconds from the failure to the job's end
FAST_STALL = {"MPITRAIN_STALL_CHECK_TIME_SECONDS": "1",
              "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "3"}


def run_failing_job(nprocs, how, meanwhile, env=()):
    """Run the job; returns (job, seconds from the failure to the job's end)."""
    with tempfile.TemporaryDirectory(prefix="mpitrain-faults-") as run_dir:
        job = run_mpi(nprocs, ["tests/scripts/rank_fails.py", how, meanwhile, run_dir],
                      env=dict(env), timeout=60)
        ended = time.time()
        assert job.returncode is not None, f"the job hung:\n{job.stderr[-3000:]}"
        elapsed = ended - float(read(os.path.join(run_dir, "failed_at")))
        pids = [int(read(os.path.join(run_dir, f"pid.{rank}"))) for rank in range(nprocs)]
        assert_nothing_left(run_dir, pids)
    print(f"\n{how} on rank {nprocs - 1} of {nprocs} while the others {meanwhile}: "
          f"the job exited with {job.returncode} {elapsed:.2f} s after the failure")
    return job, elapsed


def read(path):
    with open(path) as stream:
        return stream.read()


def assert_nothing_left(run_dir, pids):
    """No rank and no launcher process of the job may outlive it."""
    deadline = time.monotonic() + 5
    while True:
        left = _processes_mentioning(run_dir) + [pid for pid in pids if _alive(pid)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes outlived the job: {sorted(set(left))}"


def _processes_mentioning(token):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as stream:
                if token.encode() in stream.read():
                    found.append(int(entry))
        except OSError:                    # it ended while we looked
            pass
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("nprocs", [2, 3], ids=["np2", "np3"])
@pytest.mark.parametrize("meanwhile", ["allreduce", "compute"])
def test_an_unhandled_exception_aborts_every_rank(nprocs, meanwhile):
    job, elapsed = run_failing_job(nprocs, "raise", meanwhile)
    assert job.returncode != 0
    assert f"rank {nprocs - 1} of {nprocs}" in job.stderr
    assert "RuntimeError: the batch of step 5 is corrupt" in job.stderr
    assert "MPITRAIN_ABORT_ON_EXCEPTION=0 turns this off" in job.stderr
    assert elapsed < DEADLINE


def test_an_exception_in_a_thread_aborts_every_rank():
    job, elapsed = run_failing_job(3, "thread", "allreduce")
    assert job.returncode != 0
    assert "rank 2 of 3" in job.stderr and "in thread 'loader'" in job.stderr
    assert "OSError: the data file vanished" in job.stderr
    assert elapsed < DEADLINE


def test_without_the_hook_waiting_peers_still_learn_who_left():
    job, elapsed = run_failing_job(3, "raise", "allreduce",
                                   {"MPITRAIN_ABORT_ON_EXCEPTION": "0"})
    assert job.returncode != 0
    assert "aborting the MPI job" not in job.stderr
    assert "RuntimeError: the batch of step 5 is corrupt" in job.stderr
    assert "ShutdownError" in job.stderr and "rank 2: its process exited" in job.stderr
    assert elapsed < DEADLINE


@pytest.mark.parametrize("nprocs", [2, 3], ids=["np2", "np3"])
@pytest.mark.parametrize("meanwhile", ["allreduce", "compute"])
def test_a_killed_rank_ends_the_job(nprocs, meanwhile):
    job, elapsed = run_failing_job(nprocs, "sigkill", meanwhile)
    assert job.returncode != 0
    assert "signal 9" in job.stderr + job.stdout
    assert elapsed < DEADLINE


def test_a_rank_that_stops_submitting_ends_the_job_with_the_stall_report():
    job, elapsed = run_failing_job(3, "stall", "allreduce", FAST_STALL)
    assert job.returncode != 0
    report = job.stderr
    assert "stall" in report and "'gradient'" in report and "rank 2" in report
    assert "ShutdownError" in report
    assert 3 <= elapsed < DEADLINE


def test_a_frozen_rank_ends_the_job_after_the_shutdown_time():
    job, elapsed = run_failing_job(3, "freeze", "allreduce", FAST_STALL)
    assert job.returncode != 0
    assert "rank 2 did not answer within" in job.stderr or "stall" in job.stderr
    assert 3 <= elapsed < DEADLINE


@pytest.mark.parametrize("how", ["raise", "sigkill", "freeze", "stall"])
def test_elastic_training_does_not_retry_what_it_cannot_recover(how):
    """Only a reset that every rank joins is retried: a lost rank never joins."""
    job, elapsed = run_failing_job(3, how, "elastic", FAST_STALL)
    assert job.returncode != 0
    assert "elastic reset" not in job.stderr
    assert elapsed < DEADLINE


def test_the_default_settings_never_wait_forever():
    defaults = config.from_environ({})
    assert not defaults.stall_check_disable
    assert 0 < defaults.stall_check_time < defaults.stall_shutdown_time < 3600
    assert defaults.abort_on_exception


@pytest.mark.parametrize("nprocs", [2, 3], ids=["np2", "np3"])
def test_a_rank_that_exits_before_init_ends_the_job_after_the_start_timeout(nprocs):
    """Not after the stall shutdown time (600 s by default); the ranks that
    did start say which ones did not."""
    script = ("import os, sys\n"
              "if os.environ['OMPI_COMM_WORLD_RANK'] == '1':\n"
              "    sys.exit(0)\n"
              "import mpitrain as mt\n"
              "mt.init()\n"
              "mt.barrier()\n")
    started = time.monotonic()
    job = run_mpi(nprocs, ["-c", script], env={"MPITRAIN_START_TIMEOUT": "5"}, timeout=60)
    assert job.returncode not in (None, 0), job.stderr[-3000:]
    others = "rank 0" if nprocs == 2 else "ranks 0, 2"
    assert re.search(r"mpitrain: init\(\) on rank [02] waited 5 s for the other ranks to "
                     f"start: {others} started, rank 1 did not: it probably exited, or "
                     r"failed, before calling init\(\)\. Ending this rank so that the job "
                     r"ends \(MPITRAIN_START_TIMEOUT sets the wait\)", job.stderr), \
        job.stderr[-3000:]
    assert time.monotonic() - started < DEADLINE


def test_the_start_timeout_is_a_minute_and_its_own_setting():
    assert config.from_environ({}).start_timeout == 60
    assert config.from_environ({"MPITRAIN_START_TIMEOUT": "0"}).start_timeout == 0
    with pytest.raises(ValueError, match="MPITRAIN_START_TIMEOUT='-1' is not valid"):
        config.from_environ({"MPITRAIN_START_TIMEOUT": "-1"})


@pytest.mark.parametrize("intra_node, call", [
    ("mpi", "MPI_Allreduce"), ("shm", r"MPI_Barrier \(shared memory\)")])
def test_a_rank_frozen_inside_a_large_transfer_ends_the_job_after_the_shutdown_time(
        intra_node, call):
    job, elapsed = run_failing_job(3, "freeze-in-transfer", "allreduce",
                                   dict(FAST_STALL, MPITRAIN_CHUNK_SIZE="65536",
                                        MPITRAIN_INTRA_NODE=intra_node))
    assert job.returncode != 0
    assert re.search(rf"rank [01] waited \d+ s inside {call} of the allreduce of "
                     r"'big', which moved no data meanwhile: rank 2 did not answer within",
                     job.stderr), job.stderr[-3000:]
    assert 3 <= elapsed < DEADLINE


@pytest.mark.parametrize("nprocs", [2, 3], ids=["np2", "np3"])
def test_ranks_inside_different_mpi_calls_end_the_job_after_the_shutdown_time(nprocs):
    """Each waits in its call and answers the others' pings: they must still
    see that the other's call is not theirs and will never end."""
    job, elapsed = run_failing_job(nprocs, "split-route", "allreduce", FAST_STALL)
    assert job.returncode != 0
    assert re.search(r"rank \d waited \d+ s inside MPI_(Alltoallv|Waitany) of the alltoall "
                     r"of 'a2a', which moved no data meanwhile: ranks? [\d, ]+ answered "
                     r"from inside another MPI call, MPI_(Waitany|Alltoallv) of the "
                     r"alltoall of 'a2a', where (it has|they have) waited \d+ s: the ranks "
                     r"made different MPI calls", job.stderr), job.stderr[-3000:]
    assert 3 <= elapsed < DEADLINE


def test_a_rank_whose_engine_fails_tells_the_others_at_once():
    """The others wait inside MPI for a rank that will never come. With the
    default stall shutdown (600 s), and no abort of the job from the failed
    rank's unhandled exception, only that rank's notice can end the job."""
    job, elapsed = run_failing_job(3, "engine-fails", "allreduce",
                                   {"MPITRAIN_ABORT_ON_EXCEPTION": "0"})
    assert job.returncode != 0
    for rank in (0, 1):
        assert f"rank 2's mpitrain engine failed, so rank {rank}'s stopped too. Rank " \
               "2: the mpitrain engine failed on rank 2:" in job.stderr, job.stderr[-3000:]
    assert "MemoryError" in job.stderr
    assert elapsed < DEADLINE
