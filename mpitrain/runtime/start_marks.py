"""Which ranks of the job have called init(), as far as this host can tell.

A rank that never calls init() leaves the others inside MPI's start-up,
where MPI cannot tell them who is missing. So each rank, before MPI starts,
leaves a mark in the directory its launcher made for this job on this host
(Open MPI's session directory, PMIX_SERVER_TMPDIR, which the launcher removes
when the job ends); a rank that has waited too long reads the marks there.
Ranks on other hosts leave theirs on their own hosts.
"""

import os

from mpitrain.errors import RankNames

DIRECTORY = "PMIX_SERVER_TMPDIR"
_PREFIX = "mpitrain-started."


def launch_facts(environ=None):
    """(this rank, the job's rank count, the ranks on this host) as the
    launcher's environment gives them (Open MPI's or MPICH's), None where it
    does not."""
    environ = os.environ if environ is None else environ

    def number(*names):
        for name in names:
            if environ.get(name, "").isdigit():
                return int(environ[name])
        return None

    return (number("OMPI_COMM_WORLD_RANK", "PMI_RANK"),
            number("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
            number("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"))


def mark_started(rank):
    """Leave this rank's mark, where the launcher gave a job directory."""
    directory = os.environ.get(DIRECTORY)
    if not directory or rank is None:
        return
    try:
        with open(os.path.join(directory, f"{_PREFIX}{rank}"), "w"):
            pass
    except OSError:               # no mark: the report only knows less
        pass


def started_here():
    """The ranks that left their mark on this host, or None where there is
    no job directory to read."""
    directory = os.environ.get(DIRECTORY)
    try:
        names = os.listdir(directory) if directory else None
    except OSError:
        return None
    if names is None:
        return None
    return sorted(int(name[len(_PREFIX):]) for name in names
                  if name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit())


def who_started(rank, size, local_size, started):
    """A sentence on which ranks started, from launch_facts() and started_here()."""
    if started is None or size is None:
        return ("which other ranks started is not known here (the launcher gave no "
                "job directory to leave marks in)")
    names = RankNames(0, range(size))
    if local_size != size:
        return (f"on this host {names(started)} started ({len(started)} of its "
                f"{local_size or '?'} ranks); the other hosts' are not known here")
    missing = [r for r in range(size) if r not in started]
    if not missing:
        return f"all {size} ranks started, but not every one finished its start-up"
    return (f"{names(started)} started, {names(missing)} did not: "
            f"{'it' if len(missing) == 1 else 'they'} probably exited, or failed, "
            "before calling init()")
