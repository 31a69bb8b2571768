"""mpitrainrun's elastic mode with every rank on this machine: a rank lost
there restarts the job there (the launcher's own host still answers),
until the host has lost a rank again and again; a signal while it waits
for hosts ends the job with one line; the launcher hears its ranks on
loopback alone, shows no one their token, and lines that strangers send
it change nothing. tests/test_elastic_hosts.py runs elastic jobs across
hosts."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.mpi_harness import ROOT, kill_session
from tests.test_launcher import (
    LAUNCHER, WAITING_RANK, discovery_script, launch, launcher_environment, rank_pids,
    tcp_listeners)

STEPS = os.path.join("tests", "scripts", "elastic_steps.py")
# What each rank of elastic_steps.py prints at its end.
FINISHED = re.compile(r"^\[1,(\d+)\]<stdout>: rank \1: (\d+) steps, restarts (\d+), "
                      r"parameters (\w+)$", re.M)
LOST = ("mpitrainrun: rank 1 on localhost was lost: it ended without an exception "
        "(killed, by a signal or for want of memory) while localhost still answered; ")


def start_writing_to(args, folder, env=()):
    """mpitrainrun in a session of its own (for kill_session()), with ``env``
    added to its environment, its output going to folder/stdout and
    folder/stderr."""
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        return subprocess.Popen([LAUNCHER, *args], cwd=ROOT, env=launcher_environment(env),
                                stdout=stdout, stderr=stderr, text=True,
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


# Each rank opens its line to mpitrainrun and says whether it could (rank 0
# writes the job's token to RUN_DIR/token), then runs waiting_rank.py.
LINKED_AND_WAITING = f"""
import os, runpy, sys
import mpitrain as mt
from mpitrain.api import elastic_channel
mt.init()
reached = elastic_channel.link(mt.rank()) is not None
if mt.rank() == 0:
    with open(os.path.join(sys.argv[1], "token"), "w") as stream:
        stream.write(os.environ["MPITRAIN_ELASTIC_TOKEN"])
print(f"rank {{mt.rank()}} reached mpitrainrun: {{reached}}", flush=True)
runpy.run_path({os.path.join(ROOT, WAITING_RANK)!r}, run_name="__main__")
"""


def test_the_launcher_hears_its_ranks_on_loopback_alone_and_shows_no_one_their_token(
        tmp_path):
    program = tmp_path / "train.py"
    program.write_text(LINKED_AND_WAITING)
    job = start_writing_to(["-np", "2", "--verbose", "--host-discovery-script",
                            discovery_script(tmp_path, "localhost:2"), sys.executable,
                            str(program), str(tmp_path)], tmp_path)
    try:
        rank_pids(job, tmp_path, 2)
        listening = tcp_listeners(job.pid)
        (tmp_path / "stop").touch()
        job.wait(timeout=60)
    finally:
        kill_session(job.pid)
        job.wait()
    out, err = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert listening and all(address.is_loopback for address in listening), \
        f"mpitrainrun listens on {[str(address) for address in listening]}"
    assert job.returncode == 0, err
    assert sorted(re.findall(r"rank (\d) reached mpitrainrun: True$", out, re.M)) == \
        ["0", "1"], out
    token = (tmp_path / "token").read_text()
    assert token not in err, "--verbose shows the token"
    assert "MPITRAIN_ELASTIC_TOKEN='********' " in err, err


# Rank 0 sends mpitrainrun, each over a connection of its own, lines that
# are not a rank's (too deep to decode, too long, not UTF-8, a guessed
# token) and says whether mpitrainrun closed each; then rank 1 raises.
STRANGERS = """
import os, socket
import numpy as np
import mpitrain as mt
from mpitrain.api import elastic
mt.init()
state = elastic.State(step=0)
if mt.rank() == 0:
    host, _, port = os.environ["MPITRAIN_ELASTIC_ADDRESS"].rpartition(":")
    for line in [b"[" * 200000 + b"\\n", b"[" * 3000 + b"\\n", b"\\xff\\xfe\\n",
                 b'{"token": "guessed", "restart": 0, "rank": 1}\\n', b"x" * 1000000]:
        with socket.create_connection((host, int(port))) as stranger:
            stranger.settimeout(10)
            try:
                stranger.sendall(line)
                closed = stranger.recv(1) == b""
            except TimeoutError:
                closed = False
            except OSError:                 # reset: closed before all was read
                closed = True
            print(f"the stranger's {line[:4]!r}... closed: {closed}", flush=True)
mt.allreduce(np.ones(1), name="after the strangers")
if mt.rank() == 1:
    raise ValueError("the batch is corrupt")
mt.allreduce(np.ones(1), name="rank 0 waits here")
"""


def test_lines_from_strangers_are_dropped_and_a_ranks_exception_stays_that_ranks(tmp_path):
    program = tmp_path / "train.py"
    program.write_text(STRANGERS)
    job = launch(["-np", "2", "--elastic-timeout", "5", "--host-discovery-script",
                  discovery_script(tmp_path, "localhost:2"), sys.executable, str(program)])
    assert re.findall(r"closed: (\w+)", job.stdout) == ["True"] * 5, job.stdout
    assert job.stderr.rstrip().splitlines()[-1] == (
        "mpitrainrun: rank 1 failed with ValueError: the batch is corrupt (traceback "
        "above); the job ended with exit code 1"), job.stderr[-3000:]
    assert job.returncode == 1
    assert "lost" not in job.stderr and "mpitrainrun-rank-lines" not in job.stderr, \
        job.stderr[-3000:]
