"""``mpitrain.run(func, args, kwargs, num_proc=2)``: Horovod's ``horovod.run``.

The caller pickles the function and its arguments with cloudpickle (so a
lambda, a closure or a function of ``__main__`` travels by value) into a
fresh directory, starts ``python -m mpitrain.launcher.function DIRECTORY``
on every rank through mpitrainrun, and reads back each rank's return value,
or the exception it raised with its traceback. The ranks find the directory
by its path: on other hosts it must be on a shared file system, so for those
it is made in the working directory instead of /tmp.

Horovod's elastic arguments (min_num_proc, host_discovery_script, ...) make
it an elastic job of mpitrainrun (docs/fault-tolerance.md): the function is
called again in every run of the job, and the results are those of the
ranks of the last run, however many they were.
"""

import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import warnings

import cloudpickle

from mpitrain.launcher import elastic_arguments, located_pickle
from mpitrain.launcher.arguments import build_parser
from mpitrain.launcher.hosts import all_on_this_machine, parse_hosts, read_hostfile
from mpitrain.runtime import elastic_job

FUNCTION = "function.pickle"

# Horovod's arguments that mpitrain has no use for, and what to do instead;
# any value but None for them is refused.
UNSUPPORTED = {
    "ssh_port": "give it to Open MPI through mpi_args, e.g. "
                "mpi_args='--mca plm_rsh_args \"-p 2222\"'",
    "ssh_identity_file": "give it to Open MPI through mpi_args, e.g. "
                         "mpi_args='--mca plm_rsh_args \"-i ~/.ssh/key\"'",
    "output_filename": "give it to Open MPI through mpi_args, e.g. "
                       "mpi_args='--output-filename logs'",
}

class RankError(RuntimeError):
    """A rank of ``mpitrain.run`` raised: ``rank`` is the first that did,
    ``remote_traceback`` its traceback; the message has every failed rank's."""

    def __init__(self, message, rank, remote_traceback):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def run(func, args=(), kwargs=None, num_proc=1, min_num_proc=None, max_num_proc=None,
        slots=None, reset_limit=None, cooldown_range=None, hosts=None, hostfile=None,
        host_discovery_script=None, start_timeout=None, ssh_port=None,
        ssh_identity_file=None, disable_cache=None, output_filename=None, verbose=None,
        use_gloo=None, use_mpi=None, mpi_args=None, network_interface=None,
        network_interfaces=None, executable=None, np=None, min_np=None, max_np=None):
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks and return the
    list of their return values, ordered by rank.

    As Horovod's ``horovod.run``: ``hosts`` ('node1:2,node2:2') or
    ``hostfile`` say where, ``mpi_args``, ``network_interfaces`` and
    ``verbose`` go to the launcher, ``executable`` is the Python the ranks
    run (default: this one); ``min_num_proc``, ``max_num_proc``,
    ``host_discovery_script``, ``slots``, ``reset_limit`` and
    ``cooldown_range`` make it an elastic job, as mpitrainrun's flags of
    those names; ``np``, ``min_np``, ``max_np`` and ``network_interface``
    (a comma-separated string) are Horovod's deprecated spellings, accepted
    with its DeprecationWarning. ``start_timeout`` and
    ``disable_cache`` are accepted and have no effect: mpirun starts the
    ranks itself, and there is no host check to cache. A rank that raises
    makes this raise RankError with its rank and traceback; a job that fails
    otherwise raises RuntimeError with its exit code.
    """
    given = [(name, value) for name, value in locals().items()
             if name in UNSUPPORTED and value is not None]
    if given:
        name, value = given[0]
        raise ValueError(f"mpitrain.run: {name}={value!r} is not supported: "
                         f"{UNSUPPORTED[name]}")
    if use_gloo:
        raise ValueError("mpitrain.run: use_gloo=True is not supported: mpitrain "
                         "always runs on MPI")
    count_name = "num_proc"
    if np is not None:
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, 2)
        num_proc, count_name = np, "np"
    if min_np is not None:
        warnings.warn("min_np is deprecated, use min_num_proc instead",
                      DeprecationWarning, 2)
        min_num_proc = min_np
    if max_np is not None:
        warnings.warn("max_np is deprecated, use max_num_proc instead",
                      DeprecationWarning, 2)
        max_num_proc = max_np
    if network_interface:
        warnings.warn("network_interface is deprecated, use network_interfaces instead",
                      DeprecationWarning, 2)
        network_interfaces = network_interface.split(",")
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ValueError(f"mpitrain.run: {count_name} must be a whole number >= 1, "
                         f"not {num_proc!r}")
    if hosts and hostfile:
        raise ValueError("mpitrain.run: give hosts or hostfile, not both")
    host_list = (parse_hosts(hosts) if hosts
                 else read_hostfile(hostfile) if hostfile else [])
    where = None if all_on_this_machine(host_list) else os.getcwd()
    with tempfile.TemporaryDirectory(prefix="mpitrain-run-", dir=where) as directory:
        with open(os.path.join(directory, FUNCTION), "wb") as file:
            located_pickle.dump((func, tuple(args), dict(kwargs or {})), file)
        command = launcher_command(
            num_proc, hosts, hostfile, mpi_args, ",".join(network_interfaces or []), verbose,
            {"--min-np": min_num_proc, "--max-np": max_num_proc,
             "--host-discovery-script": host_discovery_script, "--slots": slots,
             "--reset-limit": reset_limit, "--blacklist-cooldown-range": cooldown_range})
        check_elastic_arguments(command)
        code = subprocess.call(
            command + [executable or sys.executable, "-m", __name__, directory],
            env=rank_environment(executable))
        outcomes = read_outcomes(directory, num_proc)
    return results_or_raise(outcomes, code)


def launcher_command(np, hosts, hostfile, mpi_args, network_interface, verbose,
                     elastic=()):
    """The mpitrainrun command; ``elastic``: {flag: value or None}."""
    line = [sys.executable, "-m", "mpitrain.launcher.run", "-np", str(np)]
    if hosts:
        line += ["-H", hosts]
    if hostfile:
        line += ["--hostfile", hostfile]
    if mpi_args:
        line += ["--mpi-args", mpi_args]
    if network_interface:
        line += ["--network-interface", network_interface]
    if verbose:
        line.append("--verbose")
    for flag, value in dict(elastic).items():
        if value is not None:
            line += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return line


def check_elastic_arguments(command):
    """Refuse, as a ValueError, elastic arguments mpitrainrun would refuse."""
    parser = build_parser()

    def refuse(message):
        raise ValueError(f"mpitrain.run: {message}")

    parser.error = refuse
    elastic_arguments.check(parser, parser.parse_args(command[3:] + ["python"]))


def rank_environment(executable):
    """This environment; with this Python on the ranks, also its sys.path, so
    that functions pickled by reference (those of importable modules) load."""
    env = dict(os.environ)
    if executable is None:
        paths = [path or os.getcwd() for path in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(
            paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def read_outcomes(directory, num_proc):
    """Each rank's ('result', value), ('error', traceback text) or None if it
    wrote none: the ranks of the job's last run (an elastic job's runs may
    have other sizes than num_proc)."""
    written = {}
    for name in os.listdir(directory):
        if name.startswith("outcome.") and not name.endswith(".part"):
            _, run, rank = name.split(".")
            with open(os.path.join(directory, name), "rb") as file:
                written.setdefault(int(run), {})[int(rank)] = pickle.load(file)
    last = written.get(max(written, default=0), {})
    size = max([outcome[2] for outcome in last.values()], default=num_proc)
    return [last[rank][:2] if rank in last else None for rank in range(size)]


def results_or_raise(outcomes, code):
    failed = [(rank, outcome[1]) for rank, outcome in enumerate(outcomes)
              if outcome is not None and outcome[0] == "error"]
    if failed:
        rank, text = failed[0]
        report = "\n".join(f"rank {r} raised:\n{t}" for r, t in failed)
        raise RankError(f"mpitrain.run: {len(failed)} of {len(outcomes)} ranks "
                        f"raised (first: rank {rank})\n{report}", rank, text)
    missing = [rank for rank, outcome in enumerate(outcomes) if outcome is None]
    if code or missing:
        raise RuntimeError(f"mpitrain.run: the job ended with exit code {code}; "
                           f"ranks that returned no result: {missing or 'none'}")
    return [value for _, value in outcomes]


def this_rank():
    return _from_mpirun(("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"), "rank")


def size_of_job():
    return _from_mpirun(("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), "job size")


def _from_mpirun(names, what):
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError("mpitrain.launcher.function runs under mpirun, started by "
                       f"mpitrain.run(); found no {what} in the environment")


def write_outcome(directory, rank, outcome):
    """Written under a temporary name and renamed, so the caller never reads
    half; the name holds the number of the run, the outcome the job's size."""
    job = elastic_job.this_job()
    path = os.path.join(directory, f"outcome.{job.restarts if job else 0}.{rank}")
    outcome += (size_of_job(),)
    with open(path + ".part", "wb") as file:
        try:
            cloudpickle.dump(outcome, file)
        except Exception:
            file.seek(0)
            file.truncate()
            cloudpickle.dump(("error", "the return value cannot be pickled:\n"
                              + traceback.format_exc(), outcome[2]), file)
    os.replace(path + ".part", path)


def main(directory):
    from mpitrain.api.elastic import RestartForNewHosts
    rank = this_rank()
    path = os.path.join(directory, FUNCTION)
    try:
        with open(path, "rb") as file:
            func, args, kwargs = pickle.load(file)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"rank {rank} cannot read {path}: ranks on other hosts need the working "
            "directory of mpitrain.run on a shared file system") from None
    try:
        value = func(*args, **kwargs)
    except RestartForNewHosts:
        raise                    # the job's next run calls the function again
    except BaseException as error:
        # The traceback from the function on, without this module's frame.
        text = "".join(traceback.format_exception(
            type(error), error, error.__traceback__.tb_next))
        write_outcome(directory, rank, ("error", text))
        raise                    # the job ends as when a script raises
    write_outcome(directory, rank, ("result", value))


if __name__ == "__main__":
    main(sys.argv[1])
