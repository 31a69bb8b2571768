"""Tasks that srun started without PMIx: each would be a job of one rank.

`srun -n 4 python train.py` without an MPI plugin (--mpi=pmix) starts four
processes that MPI cannot join: each initializes as rank 0 of a world of 1
and would train alone, four times over, never saying so (Open MPI issue
13523). init() refuses that on every task, with the fix in one line.
"""

import os

# Set by a launcher that gave MPI the job (Open MPI's mpirun, MPICH's Hydra).
_LAUNCHED_BY_MPI = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def step_tasks(environ):
    """How many tasks the srun step this process is in started (None outside a step)."""
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if name == "SLURM_NTASKS" and "SLURM_STEP_ID" not in environ:
            break           # the batch script's SLURM_NTASKS is the job's, not a step's
        if environ.get(name, "").isdigit():
            return int(environ[name]), name
    return None


def lone_task_problem(world_size, environ=None):
    """The one line to fail init() with when srun started several tasks but
    MPI sees a world of 1 in each, else ''."""
    environ = os.environ if environ is None else environ
    found = step_tasks(environ)
    if world_size != 1 or found is None or found[0] < 2 \
            or any(name in environ for name in _LAUNCHED_BY_MPI):
        return ""
    tasks, name = found
    return (f"srun started {tasks} tasks ({name}={tasks}) but MPI sees each as a job "
            f"of 1 rank, so each would train alone: srun gave MPI no PMIx. Run "
            f"`srun --mpi=pmix ...` (`srun --mpi=list` shows whether this Slurm has it), "
            f"or `mpitrainrun -np {tasks} ...` inside the allocation instead of srun")
