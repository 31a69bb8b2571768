"""The hosts a job runs on: -H's list, a hostfile, the hosts a scheduler
gave (hosts_from_scheduler), and whether they are all this machine.

Whether every rank runs here decides much of the rest: the environment
mpirun gets (job_environment in mpirun_command.py), whether the program is
checked before the job (program.py), and whether the ranks can write their
reports into a folder of this machine (run.py). The elastic host discovery
reads its script's lines as -H's (discovery.py); cores() counts this
machine's slots as Open MPI does, and shares_cores() says whether the ranks
must share them (mpitrainrun warns, and tells Open MPI).
"""

import os
import socket
import time

from mpitrain.launcher import slurm

# The hostfile Open MPI takes when given no hosts; the Kubeflow MPI Operator
# sets the first to /etc/mpi/hostfile in an MPIJob's launcher (Open MPI 5's
# own name is the second).
DEFAULT_HOSTFILE_VARIABLES = ("OMPI_MCA_orte_default_hostfile",
                              "PRTE_MCA_prte_default_hostfile")


def parse_hosts(text):
    """'a:2,b' -> [('a', 2), ('b', 1)]; a ValueError says what is wrong."""
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()) or slots == "0":
            raise ValueError(f"{item.strip()!r} is not host or host:slots "
                             "(slots a whole number >= 1)")
        hosts.append((name, int(slots or 1)))
    return hosts


def read_hostfile(path):
    """Lines 'host slots=N', 'host:N' or 'host'; '#' starts a comment."""
    hosts = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            item = words[0]
            for word in words[1:]:
                key, _, value = word.partition("=")
                if key == "slots":
                    item = f"{words[0]}:{value}"
                elif key not in ("max_slots", "max-slots"):
                    raise ValueError(f"{path}, line {number}: {word!r} is not slots=N")
            try:
                hosts += parse_hosts(item)
            except ValueError as error:
                raise ValueError(f"{path}, line {number}: {error}") from None
    if not hosts:
        raise ValueError(f"{path} names no host")
    return hosts


def is_this_machine(host):
    return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(),
                    socket.getfqdn())


def all_on_this_machine(hosts):
    """True for no hosts at all (the default) or only this machine's names."""
    return all(is_this_machine(host) for host, _ in hosts)


def cores():
    """Cores this process may run on, counted as Open MPI counts slots (no hyperthreads)."""
    cpus = os.sched_getaffinity(0)
    siblings = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings.add(f.read().strip())
        except OSError:
            return len(cpus)
    return len(siblings)


def shares_cores(hosts, nprocs):
    """Whether all ``nprocs`` ranks run on this machine, more of them than it
    has cores. Other hosts' cores are not known here."""
    return all_on_this_machine(hosts) and nprocs > cores()


def hosts_from_scheduler(environ):
    """(hosts, where they come from, how to get more slots) when mpitrainrun
    is given neither -H nor --hostfile: the default hostfile the environment
    names (an MPIJob's), else the Slurm allocation it runs in, else ([], None,
    None). ValueError or OSError for a hostfile or allocation it cannot read."""
    for name in DEFAULT_HOSTFILE_VARIABLES:
        if environ.get(name):
            try:
                hosts = read_hostfile(environ[name])
            except OSError as error:
                raise OSError(f"{name}={environ[name]}: {error.strerror}") from None
            return (hosts, f"the hostfile {environ[name]} ({name})",
                    "raise the MPIJob's slotsPerWorker or Worker replicas,")
    found = slurm.allocation(environ)
    if found is None:
        return [], None, None
    hosts, variables = found
    return (hosts, f"the Slurm allocation ({variables})",
            "ask sbatch or salloc for more tasks (-n),")


def unresolved(hosts, seconds, interval=0.5):
    """The names of ``hosts`` that still do not resolve after trying for
    ``seconds`` (none: all do). A Kubernetes worker's DNS name appears only
    seconds after the launcher's pod starts."""
    deadline = time.monotonic() + seconds
    waiting = [host for host, _ in hosts if not is_this_machine(host)]
    while True:
        waiting = [host for host in waiting if not _resolves(host)]
        if not waiting or time.monotonic() >= deadline:
            return waiting
        time.sleep(interval)


def _resolves(host):
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return True


def placement(hosts, nprocs):
    """Lines saying which ranks go to which host, as Open MPI and MPICH
    place them by default: each host's slots filled in order."""
    lines, rank = [], 0
    for host, slots in hosts:
        count = min(slots, nprocs - rank)
        if count <= 0:
            break
        ranks = (f"rank {rank}" if count == 1 else f"ranks {rank}-{rank + count - 1}")
        lines.append(f"# {ranks} on {host}")
        rank += count
    return lines
