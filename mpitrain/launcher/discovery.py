"""Which hosts an elastic job may run on: discovery, less the hosts left out.

As Horovod's: the host discovery script prints every host that can take
ranks now, one a line, as ``host:slots`` or ``host`` (then --slots, else 1,
as in -H); mpitrainrun runs it every second, in a session of its own, so
that a run that hangs is ended with all it started.

A rank lost on a host counts against that host. A process that died is not
a host that went down: the job starts again on a host that still answered
when its rank was lost, until the host has lost LOSSES_LEAVING_OUT ranks;
a host that cannot be reached, or that lost that many, is left out for the
rest of the job. With --blacklist-cooldown-range MIN MAX, Horovod's
blacklist instead: every loss leaves its host out for a time that doubles
with each of its losses, from MIN plus a random part of MIN up to MAX
seconds (Horovod's formula), after which discovery may offer it again.
"""

import os
import random
import signal
import subprocess
import time

from mpitrain.launcher.hosts import parse_hosts

# Horovod's bounds for --blacklist-cooldown-range.
COOLDOWN_LIMITS = (1, 3600)
# Lost ranks that leave a host out for the rest of the job, where it still
# answered each time: a rank that keeps dying there (a bad GPU, too little
# memory) should not restart the job for ever.
LOSSES_LEAVING_OUT = 3
SCRIPT_TIMEOUT = 60


class DiscoveryError(RuntimeError):
    """The discovery script failed or printed something that is not hosts."""


def parse_discovered(text, default_slots):
    """{host: slots}, in the order printed, from the discovery script's output."""
    hosts = {}
    for line in text.splitlines():
        item = line.strip()
        if not item:
            continue
        if ":" not in item:
            item = f"{item}:{default_slots}"
        try:
            [(host, slots)] = parse_hosts(item)
        except ValueError as error:
            raise DiscoveryError(f"the host discovery script printed {line.strip()!r}: "
                                 f"{error}") from None
        hosts[host] = slots
    return hosts


class ScriptDiscovery:
    """Hosts from --host-discovery-script."""

    def __init__(self, script, default_slots):
        self.script = script
        self.default_slots = default_slots

    def find(self):
        # A session of its own: a script that hangs is ended with every
        # process it started, not only the shell that runs it.
        process = subprocess.Popen(self.script, shell=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            out, err = process.communicate(timeout=SCRIPT_TIMEOUT)
        except BaseException as error:          # the timeout, or mpitrainrun stops
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            process.stdout.close()
            process.stderr.close()
            if isinstance(error, subprocess.TimeoutExpired):
                raise DiscoveryError(f"the host discovery script {self.script} ran longer "
                                     f"than the {SCRIPT_TIMEOUT} s it may take: it and the "
                                     "processes it started were ended") from None
            raise
        if process.returncode:
            raise DiscoveryError(f"the host discovery script {self.script} exited with "
                                 f"code {process.returncode}: {err.strip()[-500:]}")
        return parse_discovered(out, self.default_slots)


class FixedHosts:
    """The hosts of -H or --hostfile, with --min-np: a job that shrinks after losses."""

    def __init__(self, hosts):
        self.hosts = dict(hosts)

    def find(self):
        return dict(self.hosts)


class Blacklist:
    """Hosts left out after they lost ranks, and the count of each host's losses."""

    def __init__(self, cooldown_range=None):
        self.cooldown_range = cooldown_range
        self.until = {}             # host -> end of its time out (inf: for good)
        self.losses = {}

    def lost(self, host, reachable, now=None):
        """Count a rank lost on ``host``, which ``reachable`` says still
        answered then; returns for how many seconds the host is left out (0:
        it stays in the job, inf: for the rest of the job)."""
        now = time.monotonic() if now is None else now
        self.losses[host] = self.losses.get(host, 0) + 1
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            delay = low * (1 << self.losses[host]) + random.uniform(0, 1) * low
            seconds = max(low, min(high, delay))
        elif not reachable or self.losses[host] >= LOSSES_LEAVING_OUT:
            seconds = float("inf")
        else:
            return 0
        self.until[host] = now + seconds
        return seconds

    def usable(self, hosts, now=None):
        """``hosts`` ({host: slots}) without those left out now."""
        now = time.monotonic() if now is None else now
        return {host: slots for host, slots in hosts.items()
                if self.until.get(host, now) <= now}
