"""mpitrainrun's elastic mode with every rank on this machine: a rank lost
there restarts the job there (the launcher's own host still answers),
until the host has lost a rank again and again; a signal while it waits
for hosts ends the job with one line. tests/test_elastic_hosts.py runs
elastic jobs across hosts."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.mpi_harness import ROOT, kill_session
from tests.test_launcher import LAUNCHER, discovery_script, launch, launcher_environment

STEPS = os.path.join("tests", "scripts", "elastic_steps.py")
# What each rank of elastic_steps.py prints at its end.
FINISHED = re.compile(r"^\[1,(\d+)\]<stdout>: rank \1: (\d+) steps, restarts (\d+), "
                      r"parameters (\w+)$", re.M)
LOST = ("mpitrainrun: rank 1 on localhost was lost: it ended without an exception "
        "(killed, by a signal or for want of memory) while localhost still answered; ")


def start_writing_to(args, folder):
    """mpitrainrun in a session of its own (for kill_session()), its stderr
    going to folder/stderr."""
    with open(folder / "stderr", "w") as stderr:
        return subprocess.Popen([LAUNCHER, *args], cwd=ROOT, env=launcher_environment(),
                                stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                start_new_session=True)


def wait_for_text(job, path, text, timeout=90):
    """Wait until the file ``path`` holds ``text``; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert job.poll() is None, f"ended with {job.returncode}:\n{path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in:\n{path.read_text()}"
        time.sleep(0.1)


# Rank 1 takes every host out of discovery and dies; rank 0 waits to be ended.
LEAVES_NO_HOSTS = """
import os, signal, sys, time
import mpitrain as mt
mt.init()
if mt.rank() == 1:
    open(sys.argv[1], "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


@pytest.mark.parametrize("waiting", ["to start", "to restart"])
def test_a_signal_while_waiting_for_hosts_ends_the_job_with_one_line(waiting, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n" if waiting == "to start" else "localhost:2\n")
    script = discovery_script(tmp_path, f"$(cat {hosts})")
    program = tmp_path / "train.py"
    program.write_text(LEAVES_NO_HOSTS)
    job = start_writing_to(["-np", "2", "--host-discovery-script", script,
                            sys.executable, str(program), str(hosts)], tmp_path)
    try:
        wait_for_text(job, tmp_path / "stderr", f"the job needs 2 slots {waiting}")
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=30)
    finally:
        kill_session(job.pid)
        job.wait()
    said = (tmp_path / "stderr").read_text()
    assert "Traceback" not in said, said
    assert said.splitlines()[-1] == "mpitrainrun: SIGTERM: ending the job", said
    assert job.returncode == 128 + signal.SIGTERM, said


def finished(job):
    """{rank: (steps, restarts, parameters' digest)} of elastic_steps.py's ranks."""
    return {int(rank): (int(steps), int(restarts), digest)
            for rank, steps, restarts, digest in FINISHED.findall(job.stdout)}


def test_a_rank_lost_on_the_one_host_restarts_the_job_there_to_the_result_without_a_loss(
        tmp_path):
    script = discovery_script(tmp_path, "localhost:2")
    job = launch(["-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                  script, sys.executable, STEPS], timeout=240)
    assert job.returncode == 0, job.stderr[-3000:]
    said = job.stderr.splitlines()
    assert LOST + ("localhost stays in the job (1 rank lost there; at 3 it is left out); "
                   "starting the job again") in said, job.stderr[-3000:]
    assert "mpitrainrun: restart 1: 2 ranks on localhost:2" in said, job.stderr[-3000:]
    assert re.search(r"resumed from commit \d+ \(step=5\)", job.stderr), job.stderr[-3000:]
    ranks = finished(job)
    assert sorted(ranks) == [0, 1], job.stdout
    assert {(steps, restarts) for steps, restarts, _ in ranks.values()} == {(20, 1)}
    assert ranks[0][2] == ranks[1][2], "the ranks' parameters differ"
    reference = launch(["-np", "2", sys.executable, STEPS, "never"], timeout=120)
    assert finished(reference)[0] == (20, 0, ranks[0][2]), reference.stdout


def test_a_host_that_loses_a_rank_in_every_run_is_left_out_at_the_third_loss(tmp_path):
    script = discovery_script(tmp_path, "localhost:2")
    job = launch(["-np", "2", "--min-np", "1", "--elastic-timeout", "2",
                  "--host-discovery-script", script, sys.executable, STEPS, "every-run"],
                 timeout=300)
    assert job.returncode == 1, job.stderr[-3000:]
    said = job.stderr.splitlines()
    lost = [line for line in said if line.startswith(LOST)]
    assert lost == [LOST + "localhost stays in the job (1 rank lost there; at 3 it is "
                           "left out); starting the job again",
                    LOST + "localhost stays in the job (2 ranks lost there; at 3 it is "
                           "left out); starting the job again",
                    LOST + "localhost has lost 3 ranks: it is left out for the rest of "
                           "the job; starting the job again"], job.stderr[-3000:]
    assert said[-1] == ("mpitrainrun: the job needs 1 slots to restart; discovery offers 0 "
                        "usable (no hosts; localhost left out) after waiting 2 s "
                        "(--elastic-timeout): ending the job"), job.stderr[-3000:]
