"""The hosts a job runs on: -H's list, a hostfile, and whether they are all this machine.

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
