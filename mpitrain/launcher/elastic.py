"""mpitrainrun's elastic mode: the job outlives lost hosts and grows with new ones.

    mpitrainrun -np 8 --min-np 4 --max-np 12 --host-discovery-script ./hosts.sh python train.py

Under plain MPI the processes of a job are fixed and a lost rank ends it,
so mpitrainrun supervises: it runs mpirun on the hosts discovery offers
(discovery.py), and when a run ends because a rank was lost it counts the
loss against that rank's host (which it leaves out if it cannot be reached,
or has lost ranks again and again) and starts the job again on the hosts
there are, between --min-np and --max-np ranks, waiting up to
--elastic-timeout for enough.
While a run goes on it runs discovery every second; when hosts were added
(and the job is below --max-np) or one of its hosts was removed, it tells
rank 0, and the job stops at its next commit to start again on the hosts
there are. Each start resumes from the newest commit a host holds
(api/elastic_store.py), so no committed work is lost. A run that ends by
the program's own error (an exception, an exit code) ends the job: a
restart would meet the error again. Each event is one line on stderr.

How a run ended is read from the ranks' lines to mpitrainrun
(rank_lines.py), not from Open MPI's report. When no rank had opened one
(the program makes no elastic state), Open MPI's report of a rank killed
by a signal still counts as a loss.
"""

import argparse
import secrets
import subprocess
import sys
import threading
import time

from mpitrain.launcher import discovery, endings
from mpitrain.launcher.hosts import all_on_this_machine
from mpitrain.launcher.mpirun_command import (
    TAG_OUTPUT, job_environment, mpirun_command, shown)
from mpitrain.launcher.mpirun_process import (
    Stopping, raise_stopping, run_with_reports, signals_handled_by, warn_before_start)
from mpitrain.launcher.mpirun_process import warn as say
from mpitrain.launcher.program import check_program
from mpitrain.launcher.rank_lines import End, RankLines
from mpitrain.runtime import config, elastic_job

DISCOVERY_INTERVAL = 1.0            # seconds between discovery runs, as Horovod's
# Seconds mpirun may outlive a rank's end: it ends the others within one when
# it can reach them all.
ABANDON_AFTER = 30


def main(parser, args, hosts, environ, variables, mpirun, flavor):
    finder = (discovery.ScriptDiscovery(args.host_discovery_script, args.slots)
              if args.host_discovery_script else discovery.FixedHosts(hosts))
    try:
        offered = finder.find()
    except discovery.DiscoveryError as error:
        parser.exit(2, f"mpitrainrun: {error}\n")
    supervisor = Supervisor(args, finder, environ, variables, mpirun, flavor)
    if args.dry_run:
        layout = supervisor.layout(offered, args.nprocs)
        if layout is None:
            parser.exit(2, f"mpitrainrun: discovery offers {slots_text(offered)}, fewer "
                           f"than the {args.nprocs} slots -np asks for\n")
        line, env = supervisor.command(layout, args.command)
        print(shown(line, env, environ))
        return 0
    if all_on_this_machine(list(offered.items())):
        check_program(parser, args.command, job_environment(
            variables, [], args.nprocs, flavor, None, environ))
    return supervisor.supervise()


def slots_text(hosts):
    """{a: 2, b: 1} -> 'a:2, b:1' (or 'no hosts')."""
    return ", ".join(f"{host}:{slots}" for host, slots in hosts.items()) or "no hosts"


class Supervisor:
    """Runs the job again and again until it ends for good."""

    def __init__(self, args, finder, environ, variables, mpirun, flavor):
        self.args = args
        self.finder = finder
        self.environ = environ
        self.variables = variables
        self.mpirun = mpirun
        self.flavor = flavor
        self.blacklist = discovery.Blacklist(args.blacklist_cooldown_range)
        self.job_id = secrets.token_hex(8)
        self.token = secrets.token_hex(16)
        self.lines = RankLines(self.token, self.heard)
        self.restarts = 0
        self.order = []             # hosts in the order they joined: older first
        self.ran_on = set()         # hosts that may hold commits to remove
        self.offered = {}
        self.signalled = False      # a signal to mpitrainrun ended the job

    # -- the loop --

    def supervise(self):
        """Run the job until it ends for good; returns the exit code. The
        hosts' commits are removed then, unless a signal or Ctrl-C ended it
        (removing them takes another mpirun)."""
        try:
            with signals_handled_by(raise_stopping):
                code = self.runs()
        except KeyboardInterrupt:
            self.signalled, code = True, 130
        except Stopping as stopping:            # between runs: no mpirun to forward it to
            say(stopping)
            self.signalled, code = True, 128 + stopping.number
        if self.signalled and not all_on_this_machine(list(self.offered.items())):
            say(f"the job's commits stay in {self.commit_folder()} on its hosts")
        else:
            self.forget_commits()
        return code

    def runs(self):
        layout = self.wait_for(self.args.nprocs, "start")
        while layout is not None:
            code, why = self.run_once(layout)
            if why is None:
                return code
            if self.args.reset_limit is not None and self.restarts >= self.args.reset_limit:
                say(f"{why}; the job has been restarted {self.restarts} times "
                    f"(--reset-limit {self.args.reset_limit}): ending it")
                return code or 1
            say(f"{why}; starting the job again")
            self.restarts += 1
            layout = self.wait_for(self.args.min_np, "restart")
        return 1

    def run_once(self, layout):
        """Run the job once on ``layout``; returns (exit code, why to start
        it again, or None if it ended for good)."""
        size = sum(layout.values())
        self.ran_on.update(layout)
        for host in layout:
            if host not in self.order:
                self.order.append(host)
        say(f"{'restart ' + str(self.restarts) + ': ' if self.restarts else ''}"
            f"{size} rank{'s' if size > 1 else ''} on {slots_text(layout)}")
        line, env = self.command(layout, self.args.command)
        local = all_on_this_machine(list(layout.items()))
        if not self.restarts:
            warn_before_start(env, self.environ, list(layout.items()), size)
        if self.args.verbose:
            say(shown(line, env, self.environ))
        self.lines.start_run(self.restarts)
        watching, abandon = threading.Event(), threading.Event()
        watcher = threading.Thread(target=self.watch, args=(layout, watching, abandon),
                                   daemon=True, name="mpitrainrun-discovery")
        watcher.start()
        tagged = not self.args.no_tag_output and self.flavor in TAG_OUTPUT
        try:
            code, sentences, reports = run_with_reports(line, env, local, tagged,
                                                        self.args.verbose, abandon)
        finally:
            watching.set()
            watcher.join()
        if sentences is None:                   # mpitrainrun was told to stop
            self.signalled = True
            return code, None
        self.lines.settle()
        if self.lines.stopping is not None:
            stopping = self.lines.stopping
            return code, (f"the job stopped at commit {stopping['stopping']}"
                          f"{values_text(stopping)} to take in the hosts there are now")
        if code == 0:
            return code, None
        end = self.lines.first_end()
        if end is None and endings.killed_rank(sentences) is not None:
            # Open MPI's daemon on the rank's host told of the signal.
            end = End("killed", endings.killed_rank(sentences))
        if end is not None and end.kind != "exception":
            return code, self.lost(end, rank_host(layout, end.rank))
        if end is not None and not reports:     # the exception the rank told of
            reports = {end.rank: end.detail}
        say(endings.summary(code, reports, sentences))
        return code, None

    def lost(self, end, host):
        """Count the loss of ``end``'s rank against ``host``; returns the line
        that says so and what follows for the host."""
        reachable = end.kind == "killed"
        seconds = self.blacklist.lost(host, reachable)
        losses = self.blacklist.losses[host]
        what = (f"it ended without an exception (killed, by a signal or for want of "
                f"memory) while {host} still answered" if reachable else
                f"its line to mpitrainrun was still open when mpirun ended: {host} "
                "cannot be reached (down, or cut off)")
        if not seconds:
            decision = (f"{host} stays in the job ({losses} rank{'s' if losses > 1 else ''} "
                        f"lost there; at {discovery.LOSSES_LEAVING_OUT} it is left out)")
        elif seconds != float("inf"):
            decision = f"{host} is left out for {seconds:.0f} s (--blacklist-cooldown-range)"
        elif reachable:
            decision = f"{host} has lost {losses} ranks: it is left out for the rest of the job"
        else:
            decision = f"{host} is left out for the rest of the job"
        return f"rank {end.rank} on {host} was lost: {what}; {decision}"

    def wait_for(self, slots, what):
        """The layout of the next run once discovery offers ``slots`` usable
        slots, or None after --elastic-timeout."""
        deadline = time.monotonic() + self.args.elastic_timeout
        waiting = False
        while True:
            offered = self.discover()
            layout = self.layout(offered, slots)
            if layout is not None:
                return layout
            short = f"the job needs {slots} slots to {what}; {self.usable_text(offered)}"
            if time.monotonic() >= deadline:
                say(f"{short} after waiting {self.args.elastic_timeout:g} s "
                    "(--elastic-timeout): ending the job")
                return None
            if not waiting:
                say(f"{short}: waiting up to {self.args.elastic_timeout:g} s for more")
                waiting = True
            time.sleep(DISCOVERY_INTERVAL)

    def usable_text(self, offered):
        """'discovery offers 1 usable (a:1; b left out)'"""
        usable = self.blacklist.usable(offered)
        left_out = sorted(set(offered) - set(usable))
        return (f"discovery offers {sum(usable.values())} usable ({slots_text(usable)}"
                + (f"; {', '.join(left_out)} left out" if left_out else "") + ")")

    def discover(self):
        """The hosts discovery offers now; the last answer if it fails now."""
        try:
            self.offered = self.finder.find()
        except discovery.DiscoveryError as error:
            say(f"{error}; going on with the hosts it printed before")
        return self.offered

    def layout(self, offered, slots):
        """{host: ranks} for the next run: older hosts first (they keep the
        low ranks), every usable slot up to --max-np; None below ``slots``."""
        usable = self.blacklist.usable(offered)
        ordered = [h for h in self.order if h in usable] + \
                  [h for h in usable if h not in self.order]
        layout, left = {}, self.args.max_np or float("inf")
        for host in ordered:
            take = min(usable[host], left)
            if take:
                layout[host] = take
                left -= take
        return layout if sum(layout.values()) >= slots else None

    def watch(self, layout, stop, abandon):
        """While a run goes on: tell rank 0 once when the hosts changed, and
        end mpirun if it outlives a rank's end by ABANDON_AFTER seconds
        (Open MPI waits forever for a host it cannot reach)."""
        announced = False
        while not stop.wait(DISCOVERY_INTERVAL):
            since = self.lines.seconds_since_an_end()
            if since is not None and since > ABANDON_AFTER:
                say(f"mpirun has not ended {ABANDON_AFTER} s after a rank did: ending it "
                    "(it waits for a host it cannot reach)")
                abandon.set()
                return
            if not announced:
                announced = self.announce_changes(layout)

    def announce_changes(self, layout):
        """Tell rank 0 if hosts of ``layout`` left discovery, or if it offers
        more slots the job could grow to; returns whether it did."""
        usable = self.blacklist.usable(self.discover())
        removed = [host for host, ranks in layout.items() if usable.get(host, 0) < ranks]
        grown = self.layout(usable, 1)
        added = [host for host in (grown or {}) if grown[host] > layout.get(host, 0)]
        if removed:
            say(f"host{'s' if len(removed) > 1 else ''} {', '.join(removed)} left "
                "discovery: the job restarts without them at its next commit")
        elif added and sum(grown.values()) > sum(layout.values()):
            say(f"hosts added: {slots_text({h: usable[h] for h in added})}: the job "
                f"grows to {sum(grown.values())} ranks at its next commit")
        else:
            return False
        self.lines.announce_hosts_changed()
        return True

    def heard(self, message):
        """Rank 0's news of where the job resumed, said as it comes."""
        if "resumed" in message:
            say(f"resumed from commit {message['resumed']}{values_text(message)}, held by "
                f"the host of rank {message['holder']}")

    # -- one run's command --

    def command(self, layout, program):
        """(mpirun command line, its environment) to run ``program`` on ``layout``."""
        size = sum(layout.values())
        hosts = list(layout.items())
        env = job_environment(self.variables, hosts, size, self.flavor,
                              self.args.network_interface, self.environ)
        env.update(self.elastic_variables(layout))
        args = argparse.Namespace(**{**vars(self.args), "nprocs": size, "command": program})
        return mpirun_command(self.mpirun, self.flavor, args, hosts, env), env

    def elastic_variables(self, layout):
        return {elastic_job.ADDRESS: self.lines.address_for(list(layout)),
                elastic_job.TOKEN: self.token, elastic_job.JOB: self.job_id,
                elastic_job.RESTARTS: str(self.restarts)}

    def forget_commits(self):
        """Remove the job's commits from the hosts it ran on that are still usable."""
        hosts = {host: 1 for host in self.order
                 if host in self.ran_on and host in self.blacklist.usable(self.offered)}
        if not hosts:
            return
        line, env = self.command(hosts, [sys.executable, "-m", elastic_job.__name__,
                                         "remove"])
        if all_on_this_machine(list(hosts.items())):
            elastic_job.remove_this_hosts_commits(elastic_job.this_job(env))
            return
        try:
            failed = subprocess.run(line, env=env, capture_output=True,
                                    timeout=60).returncode != 0
        except subprocess.TimeoutExpired:
            failed = True
        if failed:
            say(f"could not remove the job's commits from {', '.join(hosts)}: remove "
                f"{self.commit_folder()} there")

    def commit_folder(self):
        return elastic_job.job_directory(config.from_environ(self.environ).elastic_dir,
                                         self.job_id)


def values_text(message):
    """' (epoch=3, batch=0)': the plain values of the commit a message names."""
    values = ", ".join(f"{name}={value}" for name, value in message["values"].items())
    return f" ({values})" if values else ""


def rank_host(layout, rank):
    """The host of ``rank``: mpirun fills each host's slots in order."""
    for host, ranks in layout.items():
        if rank < ranks:
            return host
        rank -= ranks
    raise ValueError(f"rank {rank} is beyond the layout {layout}")

