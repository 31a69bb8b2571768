"""Several "hosts" on this one machine, for multi-host MPI jobs in tests and benchmarks.

Each host is a Linux network namespace with an IPv4 address of its own, tied
by a veth pair to a bridge in the root namespace; the bridge has an address
on the same subnet, so mpirun, which runs in the root namespace, reaches the
daemons it starts. Each daemon also gets a hostname of its own (a UTS
namespace), so Open MPI's daemons and session directories on one host do
not mistake themselves for another's. The file system stays shared.

Open MPI 5 starts its daemons through PRRTE's ssh launcher; here an agent
script (PRTE_MCA_plm_ssh_agent; the OMPI_/rsh names are not honoured) enters
the host's namespaces instead of logging in. Like ssh, it starts the daemon
with a login's environment rather than mpirun's, so a job gets on a host
only what mpirun forwards (OMPI_* variables and -x NAME). The host names are
the IP addresses, so nothing needs /etc/hosts:

    with namespace_hosts(2) as hosts:
        env = {**job_environment(), **hosts.environment()}
        subprocess.run(["mpirun", "-np", "4", "-H", hosts.spec(2, 2), ...], env=env)

Everything made carries the tag mth<pid of the Python that made it>; a
set-up first removes what a process no longer alive left behind.
"""

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from devtools.mpi_jobs import ROOT, job_environment, kill_session

PREFIX = "mth"
SUBNETS = list(ipaddress.ip_network("10.231.0.0/16").subnets(new_prefix=24))
LOCK = os.path.join(tempfile.gettempdir(), "mpitrain-namespace-hosts.lock")

AGENT = """#!/bin/sh
# PRRTE's ssh launcher runs: {agent} HOST COMMAND-LINE
case "$1" in
{cases}
  *) echo "$0: $1 is none of the namespace hosts" >&2; exit 255 ;;
esac
shift
exec env -i HOME="$HOME" USER="$USER" LOGNAME="$LOGNAME" SHELL=/bin/sh \\
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    ip netns exec "$namespace" unshare --uts \\
    sh -c 'hostname "$0" && exec sh -c "$*"' "$hostname" "$@"
"""


class Hosts:
    """Made hosts: their addresses, names and what a job needs to reach them."""

    def __init__(self, tag, subnet, count, directory):
        self.tag = tag
        # The bridge and every host's end of its veth share this name, so
        # one interface name (mpitrainrun --network-interface) is right for
        # mpirun's side and for every host.
        self.interface = tag
        self.namespaces = [f"{tag}-h{index}" for index in range(count)]
        self.hostnames = [f"{tag}-host{index}" for index in range(count)]
        addresses = list(subnet.hosts())
        self.gateway = f"{addresses[0]}/{subnet.prefixlen}"
        self.addresses = [str(address) for address in addresses[1:count + 1]]
        self.prefixlen = subnet.prefixlen
        self.directory = directory
        self.agent = os.path.join(directory, "agent")

    def spec(self, *slots):
        """The -H value for ``slots[i]`` ranks on host i, e.g. '10.231.0.2:2,10.231.0.3:2'."""
        return ",".join(f"{address}:{count}"
                        for address, count in zip(self.addresses, slots))

    def environment(self):
        """Variables for mpirun: its daemons start through the agent. Every
        host sees this machine's cores; binding each host's ranks to them as
        if they were its own would refuse more ranks than cores on one host."""
        return {"PRTE_MCA_plm_ssh_agent": self.agent,
                "PRTE_MCA_hwloc_default_binding_policy": "none"}

    def processes(self):
        """{namespace: pids} of every process still running in a host."""
        return {namespace: _pids_in(namespace) for namespace in self.namespaces}

    def wait_until_empty(self, seconds):
        """True once no process runs in any host, False if some still do after ``seconds``."""
        deadline = time.monotonic() + seconds
        while any(self.processes().values()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def kill_processes(self):
        for namespace in self.namespaces:
            _kill_everything_in(namespace)


class HostsUnavailable(RuntimeError):
    """This machine cannot make network namespace hosts (not root, no ip, ...)."""


def run_on_hosts(command, hosts, timeout, env=()):
    """Run a job with ``env`` added to mpirun's environment; a job still
    running after ``timeout`` seconds is killed, with every process on the
    hosts, and comes back with returncode None."""
    process = subprocess.Popen(command, cwd=ROOT,
                               env=job_environment({**hosts.environment(), **dict(env)}),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(command, process.returncode, out, err)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        hosts.kill_processes()
        out, err = process.communicate()
        return subprocess.CompletedProcess(command, None, out, err)


@contextlib.contextmanager
def namespace_hosts(count):
    """Make ``count`` hosts, yield Hosts, and remove them again, whatever
    happens in between. HostsUnavailable where namespaces cannot be made."""
    reason = _unavailable()
    if reason:
        raise HostsUnavailable(reason)
    tag = f"{PREFIX}{os.getpid()}"
    with open(LOCK, "w") as lock:
        # One set-up at a time: each takes a subnet no other one uses.
        fcntl.flock(lock, fcntl.LOCK_EX)
        _remove_leftovers()
        hosts = Hosts(tag, _free_subnet(), count, tempfile.mkdtemp(prefix=tag + "-"))
        try:
            _make(hosts)
        except subprocess.CalledProcessError as error:
            _remove(tag)
            raise HostsUnavailable(f"cannot make network namespace hosts here: "
                                   f"`{' '.join(error.cmd)}` said "
                                   f"{error.stderr.strip()!r}") from None
        except BaseException:
            _remove(tag)
            raise
    try:
        yield hosts
    finally:
        _remove(tag)


def _unavailable():
    if os.geteuid() != 0:
        return "network namespace hosts need root"
    for program in ("ip", "unshare", "hostname"):
        if shutil.which(program) is None:
            return f"network namespace hosts need the program {program}"
    return None


def _ip(*args):
    return subprocess.run(["ip", *args], check=True, capture_output=True,
                          text=True).stdout


def _make(hosts):
    bridge = hosts.interface
    _ip("link", "add", bridge, "type", "bridge")
    _ip("addr", "add", hosts.gateway, "dev", bridge)
    _ip("link", "set", bridge, "up")
    cases = []
    for index, namespace in enumerate(hosts.namespaces):
        address, hostname = hosts.addresses[index], hosts.hostnames[index]
        outside = f"{hosts.tag}v{index}"
        _ip("netns", "add", namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("link", "add", outside, "type", "veth", "peer", "name", bridge,
            "netns", namespace)
        _ip("link", "set", outside, "master", bridge, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{hosts.prefixlen}", "dev", bridge)
        _ip("-n", namespace, "link", "set", bridge, "up")
        cases.append(f"  {address}) namespace={namespace} hostname={hostname} ;;")
    with open(hosts.agent, "w") as agent:
        agent.write(AGENT.format(agent=hosts.agent, cases="\n".join(cases)))
    os.chmod(hosts.agent, 0o755)


def _free_subnet():
    used = _ip("-4", "-o", "addr", "show")
    for subnet in SUBNETS:
        prefix = str(subnet.network_address).rsplit(".", 1)[0] + "."
        if f" {prefix}" not in used:
            return subnet
    raise RuntimeError("no free /24 left in 10.231.0.0/16")


def _owner(name):
    """The pid in a name this module made, else None."""
    match = re.match(rf"{PREFIX}(\d+)(-|v|$)", name)
    return int(match.group(1)) if match else None


def _namespaces():
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line]


def _links():
    return [line.split(":")[1].strip().split("@")[0]
            for line in _ip("-o", "link", "show").splitlines()]


def _temporary_directories():
    directory = tempfile.gettempdir()
    return [os.path.join(directory, name) for name in os.listdir(directory)]


def _pids_in(namespace):
    try:
        return [int(pid) for pid in _ip("netns", "pids", namespace).split()]
    except subprocess.CalledProcessError:      # the namespace is gone
        return []


def _kill_everything_in(namespace):
    for pid in _pids_in(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _remove(tag):
    """Remove every namespace, link and directory made under ``tag``; a
    namespace's processes are killed first, or they would outlive it."""
    pid = _owner(tag)
    namespaces = [name for name in _namespaces() if _owner(name) == pid]
    for namespace in namespaces:
        _kill_everything_in(namespace)
    for link in _links():
        if _owner(link) == pid:
            _ip("link", "delete", link)
    for namespace in namespaces:
        _ip("netns", "delete", namespace)
    for path in _temporary_directories():
        if _owner(os.path.basename(path)) == pid:
            shutil.rmtree(path, ignore_errors=True)


def _remove_leftovers():
    names = _namespaces() + _links() + [os.path.basename(path)
                                        for path in _temporary_directories()]
    for pid in {_owner(name) for name in names} - {None}:
        if not _alive(pid):
            _remove(f"{PREFIX}{pid}")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
