"""Exceptions that mpitrain raises."""


class MpitrainInternalError(RuntimeError):
    """A collective failed; Horovod users know this as HorovodInternalError."""


HorovodInternalError = MpitrainInternalError


class MismatchError(MpitrainInternalError):
    """Ranks submitted the same tensor name with different parameters."""


class CollectiveValueError(MpitrainInternalError, ValueError):
    """An argument of a collective was invalid on at least one rank."""


class CollectiveTypeError(MpitrainInternalError, TypeError):
    """A tensor's dtype cannot travel through mpitrain."""


class CollectiveNotImplementedError(MpitrainInternalError, NotImplementedError):
    """The requested operation exists in Horovod but not in mpitrain."""


class GpuError(MpitrainInternalError):
    """The GPU path could not run a collective: a transport, buffer or kernel failed."""


class ShutdownError(MpitrainInternalError):
    """The engine stopped: a rank shut down, a stall timed out, or MPI failed."""


ERROR_CLASSES = {
    "mismatch": MismatchError,
    "value": CollectiveValueError,
    "type": CollectiveTypeError,
    "notimplemented": CollectiveNotImplementedError,
    "shutdown": ShutdownError,
}


def not_initialized_error():
    return ValueError(
        "mpitrain has not been initialized; call mpitrain.init() "
        "(or hvd.init()) first")


def not_a_cast_compressor(call, compression):
    """The error of a collective given a compressor that moves its own payload."""
    return ValueError(
        f"{call}(compression={type(compression).__name__}(...)): this compressor "
        "sends its own payload and works only as DistributedOptimizer(compression=...) "
        f"or DistributedGradientTape(compression=...); {call} takes Compression.none, "
        ".fp16, .bf16 or a Horovod-style compressor (docs/compression.md)")


class RankNames:
    """How errors on a process set name its members: by their rank in the job,
    the number users know, not their rank in the set. On the job-wide set
    (id 0) the two agree, and errors say just "rank N"."""

    def __init__(self, set_id, job_ranks):
        self.job_ranks = job_ranks                # set rank -> job rank
        self.of_the_job = "" if set_id == 0 else " of the job"
        self.members = ("ranks" if set_id == 0
                        else f"process set {set_id} (ranks {list(job_ranks)})")

    def __call__(self, set_ranks):
        """'rank 2 of the job', 'ranks 1, 2 of the job' (set 0: 'rank 2')."""
        ranks = [self.job_ranks[rank] for rank in set_ranks]
        return (f"rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))}{self.of_the_job}")
