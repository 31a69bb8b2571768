"""The pieces of mpitrainrun's elastic mode: its flags and their mistakes,
the discovery script's output and its hangs, which hosts a loss leaves
out, the hosts' files of commits (how a commit cut short or damaged is
never loaded), and, in one job on this machine, that the program's own
error ends an elastic job instead of starting it again. tests/test_elastic_hosts.py runs elastic jobs
that lose and gain hosts."""

import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from mpitrain.api import elastic_store
from mpitrain.launcher import discovery, run
from tests.mpi_harness import ROOT, job_environment
from tests.test_launcher import running

LAUNCHER = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")


@pytest.mark.parametrize("flags, error", [
    (["--reset-limit", "2"], "--reset-limit is for elastic jobs: give "
                             "--host-discovery-script"),
    (["--min-np", "2"], "--min-np needs the hosts to choose from"),
    (["-np", "2", "--host-discovery-script", "x.sh", "-H", "a:2"],
     "give --host-discovery-script or -H/--hostfile, not both"),
    (["-np", "2", "--min-np", "3", "--host-discovery-script", "x.sh"],
     "--min-np 3 is more than -np 2"),
    (["-np", "4", "--max-np", "3", "--host-discovery-script", "x.sh"],
     "--max-np 3 is less than -np 4"),
    (["-np", "2", "--elastic-timeout", "0", "--host-discovery-script", "x.sh"],
     "--elastic-timeout must be a number of seconds > 0"),
    (["-np", "2", "--blacklist-cooldown-range", "0", "10", "--host-discovery-script",
      "x.sh"], "--blacklist-cooldown-range 0 10: give MIN <= MAX, from 1 to 3600"),
    (["--host-discovery-script", "x.sh"], "give the number of ranks to start with, -np N"),
])
def test_elastic_flags_that_do_not_fit_stop_the_launcher_with_what_to_change(
        flags, error, capsys):
    with pytest.raises(SystemExit) as ended:
        run.main(flags + ["python", "train.py"])
    assert ended.value.code == 2
    assert error in capsys.readouterr().err


def test_a_dry_run_shows_the_first_run_on_the_hosts_discovery_offers_and_no_token(tmp_path, capsys):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho node1:2\necho node2\necho node3:4\n")
    script.chmod(0o755)
    assert run.main(["-np", "2", "--max-np", "4", "--host-discovery-script", str(script),
                     "--dry-run", "python", "train.py"]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[words.index("--host") + 1] == "node1:2,node2:1,node3:1"
    assert words[words.index("-np") + 1] == "4"
    variables = dict(word.split("=", 1) for word in words if re.match(r"MPITRAIN_\w+=", word))
    assert variables["MPITRAIN_ELASTIC_RESTARTS"] == "0"
    assert variables["MPITRAIN_ELASTIC_TOKEN"] == "********"
    assert {"MPITRAIN_ELASTIC_ADDRESS", "MPITRAIN_ELASTIC_TOKEN",
            "MPITRAIN_ELASTIC_JOB"} <= set(variables)
    forwarded = [words[i + 1] for i, word in enumerate(words) if word == "-x"]
    assert {"MPITRAIN_ELASTIC_ADDRESS", "MPITRAIN_ELASTIC_RESTARTS"} <= set(forwarded)


def test_discovery_reads_horovods_lines_and_refuses_what_is_not_a_host():
    assert discovery.parse_discovered("a:2\n\nb\n  c:3  \n", 4) == {"a": 2, "b": 4, "c": 3}
    with pytest.raises(discovery.DiscoveryError,
                       match=r"printed 'a:two': 'a:two' is not host or host:slots"):
        discovery.parse_discovered("a:two\n", 1)


def test_a_script_that_fails_is_reported_with_its_exit_code_and_what_it_said(tmp_path):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho 'no cloud credentials' >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(discovery.DiscoveryError,
                       match="exited with code 3: no cloud credentials"):
        discovery.ScriptDiscovery(str(script), 1).find()


def test_a_script_that_hangs_is_ended_with_every_process_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery, "SCRIPT_TIMEOUT", 2)
    script = tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/script.pid\nsleep 600 &\n"
                      f"echo $! > {tmp_path}/sleep.pid\nwait\n")
    script.chmod(0o755)
    with pytest.raises(discovery.DiscoveryError, match=f"{script} ran longer than the 2 s "
                       "it may take: it and the processes it started were ended"):
        discovery.ScriptDiscovery(str(script), 1).find()
    started = [int((tmp_path / name).read_text()) for name in ("script.pid", "sleep.pid")]
    deadline = time.monotonic() + 5
    while any(map(running, started)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if running(pid)] == [], "still running"


def test_a_host_is_left_out_when_it_cannot_be_reached_or_at_its_third_lost_rank():
    hosts = discovery.Blacklist()
    assert hosts.lost("a", reachable=True, now=0) == 0
    assert hosts.lost("a", reachable=True, now=0) == 0
    assert hosts.usable({"a": 1}, now=1) == {"a": 1}
    assert hosts.lost("a", reachable=True, now=0) == float("inf")
    assert hosts.lost("b", reachable=False, now=0) == float("inf")
    assert hosts.usable({"a": 1, "b": 2, "c": 3}, now=1e9) == {"c": 3}


def test_with_a_cooldown_range_every_loss_leaves_a_host_out_for_a_time_that_grows():
    # Horovod's formula: MIN * 2**losses plus up to MIN more, within MIN..MAX.
    cooling = discovery.Blacklist((10, 100))
    first = cooling.lost("a", reachable=True, now=0)
    assert 20 <= first <= 30
    assert cooling.usable({"a": 1}, now=first - 0.1) == {}
    assert cooling.usable({"a": 1}, now=first) == {"a": 1}
    assert 40 <= cooling.lost("a", reachable=True, now=first) <= 50
    assert cooling.lost("a", reachable=False, now=first) <= 100
    assert cooling.lost("a", reachable=True, now=first) == 100


def commit_files(folder):
    return sorted(os.listdir(folder))


def test_a_commit_is_kept_whole_and_only_the_newest_one(tmp_path):
    folder = tmp_path / "job" / "host"
    store = elastic_store.CommitStore(str(folder), writes=True)
    store.keep(0, 1, {"values": {"step": 1}})
    store.keep(0, 2, {"values": {"step": 2}})
    store.keep(1, 7, {"values": {"other": "state"}})
    store.wait()
    assert commit_files(folder) == ["state0.commit2", "state1.commit7"]
    number, data = store.newest(0)
    assert number == 2 and elastic_store.snapshot_of(data) == {"values": {"step": 2}}
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"


def test_a_commit_cut_short_or_damaged_is_never_loaded(tmp_path):
    folder = tmp_path / "job" / "host"
    store = elastic_store.CommitStore(str(folder), writes=True)
    store.keep(0, 1, {"values": {"step": 1}})
    store.wait()
    # What a writer killed mid-write leaves: the old commit and a .partial file.
    (folder / ".state0.commit2.1a2b3c4d.partial").write_bytes(elastic_store.MAGIC + b"\x80")
    number, _ = store.newest(0)
    assert number == 1 and commit_files(folder) == ["state0.commit1"]
    # One bit flipped since it was written: refused and removed.
    data = bytearray((folder / "state0.commit1").read_bytes())
    data[len(data) // 2] ^= 1
    (folder / "state0.commit1").write_bytes(bytes(data))
    assert store.newest(0) == (-1, None)
    assert commit_files(folder) == []


def test_commits_are_not_read_from_a_folder_others_may_write_to(tmp_path):
    folder = tmp_path / "job" / "host"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    with pytest.raises(elastic_store.CommitStoreError, match="others may write to it"):
        elastic_store.CommitStore(str(folder), writes=True).newest(0)


def test_a_write_that_fails_is_raised_at_the_next_commit(tmp_path):
    blocked = tmp_path / "job"
    blocked.write_text("a file where the job's folder would go")
    store = elastic_store.CommitStore(str(blocked / "host"), writes=True)
    store.keep(0, 1, {"values": {}})
    with pytest.raises(elastic_store.CommitStoreError,
                       match=r"could not keep elastic commit 1 in .*: .*set "
                             "MPITRAIN_ELASTIC_DIR"):
        store.keep(0, 2, {"values": {}})


RAISES = """
import torch
import mpitrain.torch as hvd
hvd.init()
state = hvd.elastic.TorchState(step=0)

@hvd.elastic.run
def train(state):
    hvd.allreduce(torch.ones(1), name="before")
    if hvd.rank() == 1:
        raise ValueError("the batch is corrupt")
    hvd.allreduce(torch.ones(1), name="after")    # rank 0 waits for rank 1 here

train(state)
"""


def test_the_programs_own_error_ends_an_elastic_job_instead_of_restarting_it(tmp_path):
    hosts = tmp_path / "hosts.sh"
    hosts.write_text("#!/bin/sh\necho localhost:2\n")
    hosts.chmod(0o755)
    program = tmp_path / "train.py"
    program.write_text(RAISES)
    job = subprocess.run([LAUNCHER, "-np", "2", "--host-discovery-script", str(hosts),
                          "--blacklist-cooldown-range", "1", "1", sys.executable,
                          str(program)], cwd=ROOT, env=job_environment(),
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 1, job.stderr
    assert job.stderr.rstrip().splitlines()[-1] == (
        "mpitrainrun: rank 1 failed with ValueError: the batch is corrupt (traceback "
        "above); the job ended with exit code 1"), job.stderr
    assert "lost" not in job.stderr and "restart" not in job.stderr
