"""mpitrainrun's command line: its flags, and the MPITRAIN_* variables of
every rank that the tuning flags set, checked before any rank starts.

run.py reads the command line through build_parser() and does the rest; the
elastic flags have a file of their own (elastic_arguments.py), and
mpitrain.run (function.py) builds its mpitrainrun command line on this parser.
"""

import argparse
import difflib

from mpitrain.launcher import elastic_arguments

MiB = 1024 * 1024


def megabytes(text):
    """A size in MiB, as the whole number of bytes MPITRAIN_* variables take."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(text)
    return str(int(value * MiB))


# Launcher flags that set an MPITRAIN_* variable of every rank:
# (flags, variable, convert the value (None: a switch that sets 1), metavar, help)
SETTINGS = (
    (("--fusion-threshold-mb",), "MPITRAIN_FUSION_THRESHOLD", megabytes, "MB",
     "fuse allreduces into buffers of up to this many MiB; 0 disables fusion "
     "(default 64)"),
    (("--chunk-size-mb",), "MPITRAIN_CHUNK_SIZE", megabytes, "MB",
     "MiB reduced per MPI call; larger buffers go in pieces (default 4)"),
    (("--cycle-time-ms",), "MPITRAIN_CYCLE_TIME", str, "MS",
     "pause after a negotiation round that found nothing ready (default 1)"),
    (("--cache-capacity",), "MPITRAIN_CACHE_CAPACITY", str, "N",
     "response-cache entries; 0 disables the cache (default 1024)"),
    (("--timeline-filename",), "MPITRAIN_TIMELINE", str, "FILE",
     "rank 0 writes a Chrome-trace timeline of every collective to FILE"),
    (("--timeline-mark-cycles",), "MPITRAIN_TIMELINE_MARK_CYCLES", None, None,
     "mark every negotiation round in the timeline"),
    (("--autotune",), "MPITRAIN_AUTOTUNE", None, None,
     "tune the fusion threshold, chunk size and cycle time while the job runs"),
    (("--autotune-log-file",), "MPITRAIN_AUTOTUNE_LOG", str, "FILE",
     "rank 0 writes every autotune sample to this CSV file"),
    (("--no-stall-check",), "MPITRAIN_STALL_CHECK_DISABLE", None, None,
     "turn the stall inspector off"),
    (("--stall-check-warning-time-seconds",), "MPITRAIN_STALL_CHECK_TIME_SECONDS",
     str, "S", "warn about ranks that have not submitted a tensor after S seconds "
     "(default 60)"),
    (("--stall-check-shutdown-seconds", "--stall-check-shutdown-time-seconds"),
     "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS", str, "S",
     "end the job with a report after a stall of S seconds; 0 never (default 600)"),
    (("--log-level",), "MPITRAIN_LOG_LEVEL", str, "LEVEL",
     "trace, debug, info, warning, error or fatal on every rank (default: "
     "warning on rank 0, error on the others)"),
    (("--intra-node",), "MPITRAIN_INTRA_NODE", str, "HOW",
     "how host allreduces move between ranks of one node: shm (shared memory), "
     "mpi, or auto (default: shared memory where it is faster)"),
    (("--hierarchical-allreduce",), "MPITRAIN_HIERARCHICAL_ALLREDUCE", None, None,
     "reduce inside each node, then across nodes one slice per rank"),
    (("--hierarchical-allgather",), "MPITRAIN_HIERARCHICAL_ALLGATHER", None, None,
     "gather inside each node, then across nodes one rank per node"),
)


class Parser(argparse.ArgumentParser):
    """argparse that suggests the nearest flag for one it does not know."""

    def error(self, message):
        if message.startswith("unrecognized arguments: "):
            wrong = message.split(": ", 1)[1].split()[0]
            known = [flag for action in self._actions for flag in action.option_strings]
            close = difflib.get_close_matches(wrong.split("=")[0], known, n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        super().error(message)


def build_parser():
    parser = Parser(
        prog="mpitrainrun", allow_abbrev=False,
        usage="mpitrainrun -np N [-H HOSTS | --hostfile FILE] [options] "
              "program [args ...]",
        description="Run a training program on N ranks with MPI. Example: "
                    "mpitrainrun -np 2 python train.py")
    parser.add_argument("-np", "--num-proc", dest="nprocs", type=int, metavar="N",
                        help="number of ranks to start")
    parser.add_argument("-H", "--hosts", metavar="HOSTS",
                        help="hosts and their slots, e.g. node1:2,node2:2 "
                             "(default: the Slurm allocation, or the hostfile "
                             "OMPI_MCA_orte_default_hostfile names, else this machine)")
    parser.add_argument("-hostfile", "--hostfile", metavar="FILE",
                        help="a file of hosts, one a line: 'node1 slots=2' or 'node1:2'")
    parser.add_argument("--wait-for-hosts", type=float, default=60, metavar="S",
                        help="seconds to wait for host names that do not resolve yet "
                             "(a Kubernetes worker's appears after it starts) "
                             "(default 60)")
    parser.add_argument("--mpi-args", default="", metavar="ARGS",
                        help="more arguments for mpirun, e.g. --mpi-args='--bind-to none'")
    parser.add_argument("--network-interface", "--network-interfaces",
                        metavar="IFACE[,IFACE]",
                        help="network interfaces the ranks and MPI's launcher talk "
                             "over between hosts, e.g. eth1 or ib0,eth1")
    parser.add_argument("--no-tag-output", action="store_true",
                        help="do not prefix every line of the ranks' output with "
                             "its rank")
    for flags, _, convert, metavar, text in SETTINGS:
        if convert is None:
            parser.add_argument(*flags, action="store_true", help=text)
        else:
            parser.add_argument(*flags, type=convert, metavar=metavar, help=text)
    parser.add_argument("--verbose", action="store_true",
                        help="print which mpirun runs and the command line, and "
                             "Open MPI's own messages about how a job ended")
    parser.add_argument("-cb", "--check-build", action="store_true",
                        help="print which frameworks, MPI library and GPU support "
                             "mpitrain finds here, and exit (it imports each "
                             "framework: seconds)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mpirun command instead of running it")
    elastic_arguments.add_arguments(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program to run on every rank, e.g. python train.py")
    return parser


def setting_variables(args):
    """The MPITRAIN_* variables the flags ask for."""
    variables = {}
    for flags, name, convert, _, _ in SETTINGS:
        value = getattr(args, flags[0].lstrip("-").replace("-", "_"))
        if convert is None and value:
            variables[name] = "1"
        elif convert is not None and value is not None:
            variables[name] = value
    return variables


def check_settings(parser, variables, environ):
    """Fail here, before any rank starts, on a value init() would refuse."""
    from mpitrain.runtime import config
    flag_of = {name: flags[0] for flags, name, _, _, _ in SETTINGS}
    for name, value in variables.items():
        try:
            config.from_environ({name: value})
        except ValueError as error:
            parser.error(f"argument {flag_of[name]}: {error}")
    try:
        config.from_environ(environ)
    except ValueError as error:
        parser.error(f"in the environment: {error}")
