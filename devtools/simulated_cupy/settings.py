"""What the simulated CUDA device is asked to be: MPITRAIN_TEST_SIMULATED_GPU.

The value is a schedule, then options, separated by commas:

- ``ordered``: a stream's queued work runs, in order, only when something
  waits for it, and only as much as that wait needs;
- ``random:SEED``: the same, but each wait also runs other streams' runnable
  work in an order drawn from SEED (and the rank), as a GPU runs its streams
  side by side;
- ``quarantine``: freed device memory is never handed out again; an
  operation that touches it after the free took effect in its stream's order
  raises "use after free (freed at FILE:LINE)";
- ``shared``: every rank of a host sees the same one GPU (same PCI bus id);
  by default each rank has a GPU of its own;
- ``cuda-aware-mpi``: MPI may read device memory (arrays then offer
  ``__cuda_array_interface__``, as CUDA-aware MPI needs); without it, a
  device array handed to MPI is refused, as a plain MPI crashes on one;
- ``memory=BYTES``: each simulated GPU's memory (default 4 GiB).
"""

import dataclasses
import os

VARIABLE = "MPITRAIN_TEST_SIMULATED_GPU"
_DEFAULT_MEMORY = 4 << 30


@dataclasses.dataclass(frozen=True)
class Settings:
    seed: int | None          # None: ordered
    quarantine: bool = False
    shared: bool = False
    cuda_aware_mpi: bool = False
    memory: int = _DEFAULT_MEMORY

    @property
    def text(self):
        parts = ["ordered" if self.seed is None else f"random:{self.seed}"]
        parts += [name for name, on in (("quarantine", self.quarantine),
                                        ("shared", self.shared),
                                        ("cuda-aware-mpi", self.cuda_aware_mpi)) if on]
        if self.memory != _DEFAULT_MEMORY:
            parts.append(f"memory={self.memory}")
        return ",".join(parts)


def parse(value):
    """The Settings a value of MPITRAIN_TEST_SIMULATED_GPU asks for; ValueError if bad."""
    schedule, *options = [part.strip() for part in value.split(",")]
    if schedule == "ordered":
        seed = None
    elif schedule.startswith("random:") and schedule[7:].isdigit():
        seed = int(schedule[7:])
    else:
        raise ValueError(f"{VARIABLE}={value!r}: the schedule must be 'ordered' or "
                         "'random:SEED' (SEED an integer)")
    flags = {"quarantine": False, "shared": False, "cuda-aware-mpi": False}
    memory = _DEFAULT_MEMORY
    for option in options:
        if option in flags:
            flags[option] = True
        elif option.startswith("memory=") and option[7:].isdigit():
            memory = int(option[7:])
        else:
            raise ValueError(f"{VARIABLE}={value!r}: unknown option {option!r} (known: "
                             "quarantine, shared, cuda-aware-mpi, memory=BYTES)")
    return Settings(seed, flags["quarantine"], flags["shared"], flags["cuda-aware-mpi"],
                    memory)


def from_environment():
    """The Settings this process runs under, or None where the variable is unset."""
    value = os.environ.get(VARIABLE, "")
    return parse(value) if value else None


def local_rank():
    """This process's rank on its host, from the MPI launcher's environment."""
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def world_rank():
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0
