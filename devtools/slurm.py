"""A Slurm of this one machine for tests: munged, slurmctld, slurmd from a scratch folder.

Debian's slurm-wlm and munge (devtools/install-slurm.sh) run here as root
without a service manager. Everything they need lives in a folder of its
own: munge's key and socket, slurm.conf with ports no other Slurm uses, the
spool and state folders, pid files and logs; nothing under /etc is read or
written, so a system Slurm, if any, is left alone:

    with one_machine_slurm() as slurm:
        code, output = slurm.batch("mpitrainrun -np 2 python train.py", tasks=2)

Leaving the block ends every process started with this Slurm's
configuration (the daemons, slurmstepd, the jobs' processes: their
environment names it) and removes the folder; a set-up first does the same
for what a process no longer alive left behind.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scancel",
            "sinfo", "scontrol")
START_TIMEOUT = 30
PREFIX = "mpitrain-slurm-"


class SlurmUnavailable(RuntimeError):
    """This machine cannot run a Slurm of its own (not root, not installed)."""


class Slurm:
    """A running one-machine Slurm: its folder, configuration and node."""

    def __init__(self, directory, node, cpus):
        self.directory = directory
        self.node = node
        self.cpus = cpus
        self.conf = os.path.join(directory, "slurm.conf")
        self.munge_socket = os.path.join(directory, "munge", "munge.socket")
        self.jobs = 0

    def environment(self, extra=()):
        """The environment of a Slurm client (sbatch, srun, scontrol) of this
        Slurm: ``extra`` added, and this Slurm's configuration whatever it says."""
        return {**os.environ, **dict(extra), "SLURM_CONF": self.conf}

    def batch(self, script_body, tasks, timeout=300, env=()):
        """Run ``script_body`` (shell lines) as an sbatch job of ``tasks``
        tasks on this node and wait for it; returns (the job's exit code, its
        stdout and stderr). A job still running after ``timeout`` seconds is
        cancelled, and TimeoutError raised."""
        number, self.jobs = self.jobs, self.jobs + 1
        script = os.path.join(self.directory, f"job{number}.sh")
        output = os.path.join(self.directory, f"job{number}.out")
        with open(script, "w") as lines:
            lines.write("#!/bin/bash\n" + script_body + "\n")
        # Not sbatch --wait: it polls ever more slowly, up to half a minute late.
        job = subprocess.run(["sbatch", "--parsable", f"--ntasks={tasks}",
                              f"--output={output}", f"--chdir={os.getcwd()}", script],
                             env=self.environment(env), capture_output=True, text=True,
                             check=True).stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job)
            if state["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING",
                                         "COMPLETING"):
                break
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job], env=self.environment(),
                               capture_output=True)
                raise TimeoutError(f"job {job} ran longer than {timeout} s:\n"
                                   + _read(output)[-3000:])
            time.sleep(0.2)
        code, signal_number = map(int, state["ExitCode"].split(":"))
        return code or (128 + signal_number if signal_number else 0), _read(output)

    def job_state(self, job):
        """`scontrol show job`'s fields of ``job``: JobState, ExitCode and the rest."""
        text = subprocess.run(["scontrol", "show", "job", "--oneliner", job],
                              env=self.environment(), capture_output=True, text=True,
                              check=True).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)


def unavailable():
    """Why this machine cannot run a Slurm of its own, or None."""
    if os.geteuid() != 0:
        return "the one-machine Slurm runs its daemons as root"
    missing = [program for program in PROGRAMS if shutil.which(program) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not on PATH); "
                "devtools/install-slurm.sh installs it")
    return None


@contextlib.contextmanager
def one_machine_slurm():
    """Start munged, slurmctld and slurmd for this machine, yield Slurm, stop them again."""
    reason = unavailable()
    if reason:
        raise SlurmUnavailable(reason)
    _remove_leftovers()
    directory = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    slurm = Slurm(directory, socket.gethostname(), os.cpu_count() or 1)
    try:
        _start_munge(slurm)
        _write_configuration(slurm)
        for daemon in ("slurmctld", "slurmd"):
            _start(slurm, daemon, [daemon, "-f", slurm.conf]
                   + (["-i"] if daemon == "slurmctld" else []))
        _wait_for_idle_node(slurm)
        yield slurm
    finally:
        _end_processes(slurm.conf)
        shutil.rmtree(directory, ignore_errors=True)


def _start_munge(slurm):
    folder = os.path.dirname(slurm.munge_socket)
    # munged wants every folder above its socket open to all (x), the key private.
    os.chmod(slurm.directory, 0o711)
    os.makedirs(folder)
    os.chmod(folder, 0o711)
    key = os.path.join(folder, "munge.key")
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True,
                   capture_output=True)
    _start(slurm, "munged", [
        "munged", f"--socket={slurm.munge_socket}", f"--key-file={key}",
        f"--pid-file={os.path.join(folder, 'munged.pid')}",
        f"--log-file={os.path.join(folder, 'munged.log')}",
        f"--seed-file={os.path.join(folder, 'munged.seed')}"])


def _read(path):
    """A job's output file; none where the job never started."""
    try:
        with open(path) as text:
            return text.read()
    except FileNotFoundError:
        return ""


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for each in sockets:
            each.bind(("", 0))
        return [each.getsockname()[1] for each in sockets]
    finally:
        for each in sockets:
            each.close()


def _write_configuration(slurm):
    folder = slurm.directory
    controller_port, node_port = _free_ports(2)
    for name in ("spool", "state"):
        os.makedirs(os.path.join(folder, name))
    lines = {
        "ClusterName": "mpitrain",
        "SlurmctldHost": slurm.node,
        "SlurmctldPort": controller_port,
        "SlurmdPort": node_port,
        "SlurmUser": "root",
        "AuthType": "auth/munge",
        "AuthInfo": f"socket={slurm.munge_socket}",
        "CredType": "cred/munge",
        # No cgroups without a service manager: plain process tracking.
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "MpiDefault": "none",
        "JobAcctGatherType": "jobacct_gather/none",
        "ReturnToService": 2,
        "SlurmctldPidFile": os.path.join(folder, "slurmctld.pid"),
        "SlurmdPidFile": os.path.join(folder, "slurmd.pid"),
        "SlurmctldLogFile": os.path.join(folder, "slurmctld.log"),
        "SlurmdLogFile": os.path.join(folder, "slurmd.log"),
        "SlurmdSpoolDir": os.path.join(folder, "spool"),
        "StateSaveLocation": os.path.join(folder, "state"),
        "NodeName": f"{slurm.node} CPUs={slurm.cpus} State=UNKNOWN",
        "PartitionName": "mpitrain Nodes=ALL Default=YES OverSubscribe=YES "
                         "MaxTime=INFINITE State=UP",
    }
    with open(slurm.conf, "w") as conf:
        conf.writelines(f"{key}={value}\n" for key, value in lines.items())


def _start(slurm, daemon, command):
    """Start a daemon (it forks into the background) with this Slurm's
    environment, by which _end_processes finds it."""
    result = subprocess.run(command, env=slurm.environment(), capture_output=True,
                            text=True, timeout=START_TIMEOUT)
    if result.returncode:
        raise SlurmUnavailable(f"{daemon} did not start: {result.stderr.strip()}"
                               f"{_log_tail(slurm, daemon)}")


def _wait_for_idle_node(slurm):
    deadline = time.monotonic() + START_TIMEOUT
    state = ""
    while time.monotonic() < deadline:
        result = subprocess.run(["sinfo", "--noheader", "--format=%T"],
                                env=slurm.environment(), capture_output=True, text=True)
        state = (result.stdout + result.stderr).strip()
        if state == "idle":
            return
        time.sleep(0.5)
    raise SlurmUnavailable(f"the node {slurm.node} is not idle after {START_TIMEOUT} s "
                           f"(sinfo says {state!r}){_log_tail(slurm, 'slurmctld')}"
                           f"{_log_tail(slurm, 'slurmd')}")


def _log_tail(slurm, daemon):
    path = os.path.join(slurm.directory, f"{daemon}.log")
    if daemon == "munged":
        path = os.path.join(os.path.dirname(slurm.munge_socket), "munged.log")
    try:
        return f"\n{daemon}.log ends:\n" + "".join(open(path).readlines()[-10:])
    except OSError:
        return ""


def _end_processes(conf):
    """SIGTERM every process whose environment names ``conf``, SIGKILL
    those still there after a few seconds (slurmstepd of a stuck step)."""
    marker = f"SLURM_CONF={conf}".encode()
    for number in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + 5
        pids = _started_with(marker)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)


def _started_with(marker):
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if marker in environ.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _remove_leftovers():
    """End and remove the Slurms of set-ups whose process is gone."""
    scratch = tempfile.gettempdir()
    for name in os.listdir(scratch):
        owner = name[len(PREFIX):].split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not _alive(int(owner)):
            folder = os.path.join(scratch, name)
            _end_processes(os.path.join(folder, "slurm.conf"))
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of an exited daemon counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
