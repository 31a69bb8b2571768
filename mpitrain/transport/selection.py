"""Which transport carries the job's device buffers, decided once, alike on every rank.

At init every rank reports what it has (its GPUs, NCCL, a CUDA-aware MPI,
its MPITRAIN_GPU_OPERATIONS) and every rank applies ``choose`` to the same
reports. ``auto`` takes NCCL where every rank has a GPU of its own and
NCCL loads everywhere; otherwise MPI carries device buffers, directly where
the library is CUDA-aware and through pinned host memory where it is not.
An explicit ``nccl`` that cannot work fails init on every rank, saying why.
"""

import collections
import dataclasses
import socket

from mpitrain.backends import arrays


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What one rank can use to move device buffers."""

    host: str
    node: int              # the job rank of the first rank on this rank's node
    gpus: tuple            # PCI bus ids of the CUDA devices this rank sees
    why_no_gpu: str
    nccl: int              # NCCL's version, 0 where it does not load
    why_no_nccl: str
    cuda_aware: bool
    setting: str           # MPITRAIN_GPU_OPERATIONS: auto, nccl or mpi


@dataclasses.dataclass(frozen=True)
class Plan:
    nccl: bool             # device allreduces go through NCCL
    setting: str
    reason: str
    gpus: bool = True      # some rank has a CUDA device
    cuda_aware: bool = False   # every rank's MPI reads device memory


def local_facts(node, setting, cuda_aware):
    cupy = arrays.cupy()
    gpus, why_no_gpu = (), arrays.why_no_cupy()
    if cupy is not None:
        try:
            runtime = cupy.cuda.runtime
            gpus = tuple(runtime.deviceGetPCIBusId(i)
                         for i in range(runtime.getDeviceCount()))
        except Exception as error:      # a device that cannot even be named is no use
            why_no_gpu = f"its GPUs cannot be queried: {type(error).__name__}: {error}"
    return DeviceFacts(socket.gethostname(), node, gpus, why_no_gpu,
                       arrays.nccl_version(), arrays.why_no_nccl(), cuda_aware, setting)


def choose(facts):
    """The Plan for ranks with these facts (one per rank, in rank order), whose
    settings agree (init checks that first).

    Raises ValueError where the setting asks for NCCL and it cannot work.
    """
    setting = facts[0].setting
    gpus = any(f.gpus for f in facts)
    # A rank whose MPI cannot read device memory stages its buffers, and its
    # host copy may take shared memory while the others call MPI: all or none.
    aware = all(f.cuda_aware for f in facts)
    if setting == "mpi":
        return Plan(False, setting, "MPITRAIN_GPU_OPERATIONS=mpi", gpus, aware)
    blockers = nccl_blockers(facts)
    if not blockers:
        return Plan(True, setting,
                    "MPITRAIN_GPU_OPERATIONS=nccl" if setting == "nccl" else
                    f"every rank has a GPU of its own and NCCL {facts[0].nccl} loads",
                    cuda_aware=aware)
    if setting == "nccl":
        raise ValueError(
            "MPITRAIN_GPU_OPERATIONS=nccl cannot work here: " + "; ".join(blockers)
            + ". Use MPITRAIN_GPU_OPERATIONS=mpi (device buffers then go through "
            "CUDA-aware MPI, or through host memory), or leave it unset and let "
            "mpitrain choose")
    return Plan(False, setting, blockers[0], gpus, aware)


def nccl_blockers(facts):
    """Why NCCL cannot serve ranks with these facts; empty where it can."""
    blockers = []
    without_gpu = [r for r, f in enumerate(facts) if not f.gpus]
    for why, ranks in _group([facts[r] for r in without_gpu], lambda f: f.why_no_gpu,
                             without_gpu).items():
        blockers.append(f"{_ranks(ranks)} {_has(ranks)} no CUDA device ({why})")
    without_nccl = [r for r, f in enumerate(facts) if f.gpus and not f.nccl]
    for why, ranks in _group([facts[r] for r in without_nccl], lambda f: f.why_no_nccl,
                             without_nccl).items():
        blockers.append(f"{_ranks(ranks)} cannot use NCCL ({why})")
    with_gpu = [r for r, f in enumerate(facts) if f.gpus]
    for _, ranks in _group([facts[r] for r in with_gpu], lambda f: f.node,
                           with_gpu).items():
        devices = sorted(set().union(*(facts[r].gpus for r in ranks)))
        if len(devices) < len(ranks):
            blockers.append(
                f"{_ranks(ranks)} share the {_count(len(devices), 'GPU')} of host "
                f"'{facts[ranks[0]].host}' ({', '.join(devices)}), and NCCL "
                "needs a GPU for each rank")
    return blockers


def describe(plan, cuda_aware):
    """How this rank's device allreduces travel, for logs and --check-build.

    cuda_aware is None where the MPI library has not been asked yet.
    """
    if not plan.gpus:
        return f"none needed ({plan.reason})"
    if plan.nccl:
        return f"NCCL ({plan.reason})"
    if cuda_aware is None:
        return (f"CUDA-aware MPI where the library is (MPI says so when it starts), "
                f"else MPI staged through pinned host memory ({plan.reason})")
    if cuda_aware:
        return f"CUDA-aware MPI ({plan.reason})"
    return (f"MPI, staged through pinned host memory ({plan.reason}; the MPI "
            "library is not CUDA-aware)")


def describe_this_host(facts):
    """Lines for `mpitrainrun --check-build`: the transport of jobs on this host."""
    if not facts.gpus:
        return [f"device transport: none needed, no CUDA device here ({facts.why_no_gpu})"]
    gpus = len(facts.gpus)
    lines = [f"device transport (MPITRAIN_GPU_OPERATIONS={facts.setting}):"]
    for ranks, label in ((gpus, f"up to {_count(gpus, 'rank')} on this host"),
                         (gpus + 1, f"{gpus + 1} or more ranks on this host")):
        try:
            line = describe(choose([facts] * ranks), facts.cuda_aware)
        except ValueError as error:
            line = f"init() fails: {error}"
        lines.append(f"  {label}: {line}")
    return lines


def _group(items, key, ranks=None):
    """{key: [ranks]} in first-seen order; ranks default to the items' positions."""
    grouped = collections.defaultdict(list)
    for rank, item in zip(range(len(items)) if ranks is None else ranks, items):
        grouped[key(item)].append(rank)
    return dict(grouped)


def _ranks(ranks):
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else "ranks " + ", ".join(map(str, ranks)))


def _has(ranks):
    return "has" if len(ranks) == 1 else "have"


def _count(number, noun):
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
