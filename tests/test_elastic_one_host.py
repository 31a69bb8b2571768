"""mpitrainrun's elastic mode with every rank on this machine: a signal
while it waits for hosts ends the job with one line.
tests/test_elastic_hosts.py runs elastic jobs across hosts."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.mpi_harness import ROOT, kill_session
from tests.test_launcher import LAUNCHER, discovery_script, launcher_environment


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
