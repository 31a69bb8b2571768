"""mpitrainrun's elastic mode across hosts (network namespaces, devtools/hosts.py):
a job whose rank is killed on a host that still answers starts again on
every host from its last commit; one that loses a host (cut off from the
network, or left out by Horovod's blacklist) goes on with the others from
its last commit; one that is offered a host grows at its next commit, one
left with too few waits --elastic-timeout and ends, a loss in the middle of
a commit's write resumes from the commit before, and Keras's fit resumes as
torch's loop does. Each result is compared with a plain mpirun job started
from the commit the elastic job resumed from, as the script itself saved it
(tests/scripts/elastic_training.py)."""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.mpi_harness import ROOT, kill_session
from tests.test_elastic_one_host import LINKED_AND_WAITING, start_writing_to
from tests.test_launcher import rank_pids, tcp_listeners
from tests.test_multihost import LAUNCHER, MPIRUN, hosts, run, succeeded  # noqa: F401

SCRIPT = os.path.join(ROOT, "tests", "scripts", "elastic_training.py")
KERAS_SCRIPT = os.path.join(ROOT, "tests", "scripts", "elastic_keras_training.py")
QUIET_TENSORFLOW = {"TF_CPP_MIN_LOG_LEVEL": "2"}
# What mpitrainrun says when the job resumes: "resumed from commit 6 (epoch=1, batch=2)"
RESUMED = re.compile(r"resumed from commit (\d+) \(epoch=(\d+), batch=(\d+)\)")
# Horovod's default: the first loss leaves a host out (here for an hour).
HOROVODS_BLACKLIST = ["--blacklist-cooldown-range", "3600", "3600"]


def discovery(tmp_path, hosts, *indices):
    """A discovery script that prints the lines of a file, which starts
    with hosts ``indices``, one slot each; returns (script, the file)."""
    listed = tmp_path / "hosts"
    listed.write_text("".join(f"{hosts.addresses[i]}:1\n" for i in indices))
    script = tmp_path / "discover_hosts.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    return str(script), str(listed)


def elastic_job(hosts, tmp_path, flags, script_args, script=SCRIPT, timeout=240, env=()):
    out = tmp_path / "elastic"
    out.mkdir()
    job = run([LAUNCHER, *flags, sys.executable, script, str(out), *script_args],
              hosts, timeout, env)
    return job, out


def three_hosts_then_two(hosts, tmp_path, script_args, script=SCRIPT, flags=(), **options):
    """An elastic job of one rank on each of the three hosts, which may go on
    with two (--min-np 2); returns (job, the script's output folder)."""
    discover, _ = discovery(tmp_path, hosts, 0, 1, 2)
    return elastic_job(hosts, tmp_path, ["-np", "3", "--min-np", "2",
                                         "--host-discovery-script", discover, *flags],
                       script_args, script, **options)


def reference_job(hosts, tmp_path, indices, commit, script=SCRIPT, env=()):
    """A plain mpirun job, one rank on each host of ``indices``, from ``commit``."""
    out = tmp_path / "reference"
    out.mkdir()
    forwarded = [flag for name in ["OMP_NUM_THREADS", *dict(env)] for flag in ("-x", name)]
    command = [MPIRUN, "-np", str(len(indices)), "-H",
               ",".join(f"{hosts.addresses[i]}:1" for i in indices), *forwarded,
               sys.executable, script, str(out), "--start-from", str(commit)]
    succeeded(run(command, hosts, timeout=180, env=env))
    return out


def resumed_at(stderr):
    found = RESUMED.findall(stderr)
    assert len(found) == 1, stderr[-3000:]
    return int(found[0][1]), int(found[0][2])


def assert_same_model(elastic_out, reference_out):
    got = torch.load(elastic_out / "final.pt")
    want = torch.load(reference_out / "final.pt")
    assert list(got) == list(want)
    for name in got:
        assert torch.equal(got[name], want[name]), name


def commits_left(hosts):
    """The hosts' folders of elastic commits still in /dev/shm."""
    return sorted(os.path.basename(folder) for name in hosts.hostnames
                  for folder in glob.glob(f"/dev/shm/mpitrain-elastic-*/{name}"))


@pytest.fixture
def no_commits_left_behind(hosts):
    yield
    for name in hosts.hostnames:
        for folder in glob.glob(f"/dev/shm/mpitrain-elastic-*/{name}"):
            shutil.rmtree(os.path.dirname(folder), ignore_errors=True)


def test_a_rank_killed_on_a_host_that_answers_restarts_the_job_on_every_host(
        hosts, tmp_path, no_commits_left_behind):
    """From the last commit; a process that died is not a host that went down."""
    job, out = three_hosts_then_two(hosts, tmp_path, ["--kill-at", "1:3"])
    succeeded(job)
    lost = hosts.addresses[2]
    assert (f"rank 2 on {lost} was lost: it ended without an exception (killed, by a "
            f"signal or for want of memory) while {lost} still answered; {lost} stays in "
            "the job (1 rank lost there; at 3 it is left out); starting the job again"
            in job.stderr), job.stderr[-3000:]
    assert f"restart 1: 3 ranks on {hosts.spec(1, 1, 1).replace(',', ', ')}" \
        in job.stderr, job.stderr[-3000:]
    # Killed after epoch 1's third batch: the last commit was after its second.
    assert resumed_at(job.stderr) == (1, 2)
    assert "finished with 3 ranks after 1 restarts" in job.stdout
    killed = float(re.search(r"killed at epoch 1 batch 3, time (\S+)", job.stdout).group(1))
    resumed = float(re.search(r"first step after the restart done, time (\S+)",
                              job.stdout).group(1))
    print(f"from the kill to the first step after the restart: {resumed - killed:.1f} s")
    assert 0 < resumed - killed < 60
    reference = reference_job(hosts, tmp_path, [0, 1, 2], out / "commit-r0-e1-b2.pt")
    assert_same_model(out, reference)
    assert commits_left(hosts) == []


def test_a_host_cut_off_from_the_network_is_left_out_and_the_job_goes_on(
        hosts, tmp_path, no_commits_left_behind):
    """The survivors' collectives give up after the stall shutdown time (5 s
    here), but Open MPI then waits forever for the host it cannot reach:
    mpitrainrun ends mpirun and starts the job again without that host, whose
    line to it never closed."""
    try:
        job, out = three_hosts_then_two(hosts, tmp_path,
                                        ["--cut-link-at", "1:3", hosts.interface],
                                        timeout=300,
                                        env={"MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "5"})
    finally:
        subprocess.run(["ip", "-n", hosts.namespaces[2], "link", "set", hosts.interface,
                        "up"], check=True)
        hosts.kill_processes()             # what was left running on the cut host
    succeeded(job)
    assert "rank 2 cuts its host off at epoch 1 batch 3" in job.stdout
    assert "mpirun has not ended 30 s after a rank did: ending it" in job.stderr
    cut = hosts.addresses[2]
    assert (f"rank 2 on {cut} was lost: its line to mpitrainrun was still open when "
            f"mpirun ended: {cut} cannot be reached (down, or cut off); {cut} is left out "
            "for the rest of the job" in job.stderr), job.stderr[-3000:]
    assert resumed_at(job.stderr) == (1, 2)
    reference = reference_job(hosts, tmp_path, [0, 1], out / "commit-r0-e1-b2.pt")
    assert_same_model(out, reference)


def test_a_host_added_to_discovery_grows_the_job_at_its_next_commit(
        hosts, tmp_path, no_commits_left_behind):
    script, listed = discovery(tmp_path, hosts, 0, 1)
    third = f"{hosts.addresses[2]}:1"
    # Rank 0 adds the third host after epoch 0's second batch; each batch
    # takes 0.3 s, so discovery, run every second, sees it within a few
    # batches, and the job stops at the commit after that.
    job, out = elastic_job(hosts, tmp_path,
                           ["-np", "2", "--max-np", "3", "--host-discovery-script", script],
                           ["--add-host-at", "0:2", listed, third, "--sleep", "0.3"])
    succeeded(job)
    assert f"hosts added: {third}: the job grows to 3 ranks at its next commit" \
        in job.stderr, job.stderr[-3000:]
    stopped = re.search(r"the job stopped at commit (\d+) \(epoch=(\d+), batch=(\d+)\) "
                        "to take in the hosts there are now", job.stderr)
    assert stopped, job.stderr[-3000:]
    assert f"restart 1: 3 ranks on {hosts.addresses[0]}:1, {hosts.addresses[1]}:1, " \
           f"{third}" in job.stderr
    epoch, batch = resumed_at(job.stderr)
    assert (epoch, batch) == (int(stopped.group(2)), int(stopped.group(3)))
    assert (epoch, batch) >= (0, 2)
    assert "finished with 3 ranks after 1 restarts" in job.stdout
    reference = reference_job(hosts, tmp_path, [0, 1, 2],
                              out / f"commit-r0-e{epoch}-b{batch}.pt")
    assert_same_model(out, reference)
    assert commits_left(hosts) == []


def test_below_the_fewest_ranks_the_job_waits_the_elastic_timeout_then_ends(
        hosts, tmp_path, no_commits_left_behind):
    script, _ = discovery(tmp_path, hosts, 0, 1)
    job, _ = elastic_job(hosts, tmp_path,
                         ["-np", "2", "--min-np", "2", "--elastic-timeout", "3",
                          "--host-discovery-script", script, *HOROVODS_BLACKLIST],
                         ["--kill-at", "0:1"])
    assert job.returncode == 1, job.stderr[-3000:]
    lost, left = hosts.addresses[1], hosts.addresses[0]
    assert f"rank 1 on {lost} was lost" in job.stderr, job.stderr[-3000:]
    assert job.stderr.rstrip().endswith(
        f"mpitrainrun: the job needs 2 slots to restart; discovery offers 1 usable "
        f"({left}:1; {lost} left out) after waiting 3 s (--elastic-timeout): ending "
        "the job"), job.stderr[-3000:]
    assert "restart 1" not in job.stderr


def test_a_loss_while_a_commit_is_written_resumes_from_the_commit_before(
        hosts, tmp_path, no_commits_left_behind):
    # The commit after epoch 1's second batch never finishes its write; the
    # last rank dies at the next batch.
    job, out = three_hosts_then_two(hosts, tmp_path, ["--stall-write-at", "1:2"],
                                    flags=HOROVODS_BLACKLIST)
    succeeded(job)
    assert "killed at epoch 1 batch 3" in job.stdout
    assert resumed_at(job.stderr) == (1, 0)         # the commit at the end of epoch 0
    reference = reference_job(hosts, tmp_path, [0, 1], out / "commit-r0-e1-b0.pt")
    assert_same_model(out, reference)


def test_keras_a_lost_host_leaves_fit_on_the_others_from_the_last_commit(
        hosts, tmp_path, no_commits_left_behind):
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed")
    job, out = three_hosts_then_two(hosts, tmp_path, ["--kill-at", "1:1"], KERAS_SCRIPT,
                                    flags=HOROVODS_BLACKLIST, timeout=300)
    succeeded(job)
    lost = hosts.addresses[2]
    assert (f"rank 2 on {lost} was lost: it ended without an exception (killed, by a "
            f"signal or for want of memory) while {lost} still answered; {lost} is left "
            "out for 3600 s (--blacklist-cooldown-range)" in job.stderr), job.stderr[-3000:]
    # Keras commits at the ends of epochs: back to the end of epoch 0.
    assert resumed_at(job.stderr) == (1, 0)
    assert "finished with 2 ranks after 1 restarts" in job.stdout
    reference = reference_job(hosts, tmp_path, [0, 1], out / "commit-r0-e1.npz",
                              KERAS_SCRIPT, QUIET_TENSORFLOW)
    got, want = np.load(out / "final.npz"), np.load(reference / "final.npz")
    assert got.files == want.files
    for name in got.files:
        np.testing.assert_array_equal(got[name], want[name])


def test_the_launcher_listens_on_the_address_its_ranks_reach_it_by_alone(hosts, tmp_path):
    """The bridge's: the interface the route to the hosts leaves by."""
    script, _ = discovery(tmp_path, hosts, 0, 1)
    program = tmp_path / "train.py"
    program.write_text(LINKED_AND_WAITING)
    job = start_writing_to(["-np", "2", "--host-discovery-script", script, sys.executable,
                            str(program), str(tmp_path)], tmp_path, hosts.environment())
    try:
        rank_pids(job, tmp_path, 2)
        listening = [str(address) for address in tcp_listeners(job.pid)]
        (tmp_path / "stop").touch()
        job.wait(timeout=60)
    finally:
        kill_session(job.pid)
        hosts.kill_processes()
        job.wait()
    out, err = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert listening == [hosts.gateway.split("/")[0]], listening
    assert job.returncode == 0, err[-3000:]
    assert sorted(re.findall(r"rank (\d) reached mpitrainrun: True$", out, re.M)) == \
        ["0", "1"], out
