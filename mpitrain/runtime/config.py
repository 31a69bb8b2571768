"""Every runtime knob: MPITRAIN_* environment variables, HOROVOD_* aliases."""

import dataclasses
import os

from mpitrain.runtime import logs

MiB = 1024 * 1024
# Longer cycles would only hold ready operations back: the engine pauses no
# longer than an idle rank's heartbeat, a round a second, anyway.
MAX_CYCLE_TIME_MS = 1000.0


@dataclasses.dataclass(frozen=True)
class Config:
    fusion_threshold: int = 64 * MiB       # bytes of allreduce fused per buffer
    chunk_size: int = 4 * MiB              # bytes per MPI allreduce call
    cycle_time_ms: float = 1.0             # pause after a round that found nothing ready
    cache_capacity: int = 1024             # response-cache entries; 0 disables it
    stall_check_disable: bool = False
    stall_check_time: float = 60.0         # seconds before a stall warning
    # Horovod's default (0, never) leaves hung jobs holding machines forever.
    stall_shutdown_time: float = 600.0     # seconds before a stall ends the job; 0 never
    start_timeout: float = 60.0            # seconds init() waits for every rank; 0 forever
    timeline: str = ""                     # Chrome-trace file written by rank 0
    timeline_mark_cycles: bool = False
    autotune: bool = False                 # tune fusion, chunk and cycle on the live job
    autotune_log: str = ""                 # CSV file of what autotune tried (rank 0)
    log_level: str = ""                    # "": warnings on rank 0, errors elsewhere
    abort_on_exception: bool = True        # an unhandled exception aborts the whole job
    elastic_reset_limit: int = 3           # resets elastic.run tries before giving up; 0: no limit
    elastic_dir: str = "/dev/shm"          # where each host keeps an elastic job's commits
    cuda_aware: str = "auto"               # does MPI take device buffers: auto, 1, 0
    gpu_operations: str = "auto"           # device allreduces over nccl, mpi, or auto
    intra_node: str = "auto"               # host allreduces inside a node: shm, mpi, or auto
    hierarchical_allreduce: bool = False   # reduce inside nodes, then across them
    hierarchical_allgather: bool = False   # gather inside nodes, then across them
    # For testing: a set of one rank moves its allreduces as a larger set does
    # (fusion buffer, kernels, NCCL, CUDA-aware or staged MPI) instead of nothing.
    test_one_rank_pipeline: bool = False
    explicit: frozenset = frozenset()      # fields the user set; autotune leaves them alone


def _nonnegative_int(text):
    value = int(text)
    if value < 0:
        raise ValueError
    return value


def _positive_float(text):
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError
    return value


def _positive_int(text):
    value = int(text)
    if value <= 0:
        raise ValueError
    return value


def _nonnegative_float(text):
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError
    return value


def _number_up_to(most):
    def parse(text):
        value = _nonnegative_float(text)
        if value > most:
            raise ValueError
        return value
    return parse


def _choice(*choices):
    def parse(text):
        value = text.strip().lower()
        if value not in choices:
            raise ValueError
        return value
    return parse


def _flag(text):
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


_VARIABLES = {
    # field: (suffix, parser, what it accepts)
    "fusion_threshold": ("FUSION_THRESHOLD", _nonnegative_int,
                         "a whole number of bytes >= 0 (0 disables fusion)"),
    "chunk_size": ("CHUNK_SIZE", _positive_int, "a whole number of bytes > 0"),
    "cycle_time_ms": ("CYCLE_TIME", _number_up_to(MAX_CYCLE_TIME_MS),
                      f"a number of milliseconds >= 0 and <= {MAX_CYCLE_TIME_MS:g}"),
    "cache_capacity": ("CACHE_CAPACITY", _nonnegative_int,
                       "a whole number of entries >= 0 (0 disables the cache)"),
    "stall_check_disable": ("STALL_CHECK_DISABLE", _flag, "0 or 1"),
    "stall_check_time": ("STALL_CHECK_TIME_SECONDS", _positive_float,
                         "a number of seconds > 0"),
    "stall_shutdown_time": ("STALL_SHUTDOWN_TIME_SECONDS", _nonnegative_float,
                            "a number of seconds >= 0 (0 never shuts down)"),
    "start_timeout": ("START_TIMEOUT", _nonnegative_float,
                      "a number of seconds >= 0 (0 waits forever)"),
    "timeline": ("TIMELINE", str, "a file path"),
    "timeline_mark_cycles": ("TIMELINE_MARK_CYCLES", _flag, "0 or 1"),
    "autotune": ("AUTOTUNE", _flag, "0 or 1"),
    "autotune_log": ("AUTOTUNE_LOG", str, "a file path"),
    "log_level": ("LOG_LEVEL", logs.level_name,
                  "one of trace, debug, info, warning, error, fatal"),
    "abort_on_exception": ("ABORT_ON_EXCEPTION", _flag, "0 or 1"),
    "elastic_reset_limit": ("ELASTIC_RESET_LIMIT", _nonnegative_int,
                            "a whole number of resets >= 0 (0: no limit)"),
    "elastic_dir": ("ELASTIC_DIR", str, "a folder path"),
    "cuda_aware": ("CUDA_AWARE", _choice("auto", "1", "0"), "auto, 1 or 0"),
    "gpu_operations": ("GPU_OPERATIONS", _choice("auto", "mpi", "nccl"),
                       "auto, mpi or nccl"),
    "intra_node": ("INTRA_NODE", _choice("auto", "shm", "mpi"), "auto, shm or mpi"),
    "hierarchical_allreduce": ("HIERARCHICAL_ALLREDUCE", _flag, "0 or 1"),
    "hierarchical_allgather": ("HIERARCHICAL_ALLGATHER", _flag, "0 or 1"),
    "test_one_rank_pipeline": ("TEST_ONE_RANK_PIPELINE", _flag, "0 or 1"),
}


# Settings every rank must share: they shape the fusion plans, the pieces of
# every MPI call, the response cache's slots, the elastic retries and the
# transports. A rank with another value would not hang politely: it would
# pair mismatched MPI calls.
MUST_AGREE = ("fusion_threshold", "chunk_size", "cache_capacity", "elastic_reset_limit",
              "gpu_operations", "intra_node", "hierarchical_allreduce",
              "hierarchical_allgather")


def disagreement(configs):
    """Which setting differs between the ranks' configs (one per rank), or ""."""
    for field in MUST_AGREE:
        ranks_of = {}
        for rank, settings in enumerate(configs):
            ranks_of.setdefault(getattr(settings, field), []).append(rank)
        if len(ranks_of) > 1:
            return (f"MPITRAIN_{_VARIABLES[field][0]} differs between ranks ("
                    + "; ".join(f"rank{'s' if len(ranks) > 1 else ''} "
                                f"{', '.join(map(str, ranks))}: {value}"
                                for value, ranks in ranks_of.items())
                    + "): every rank must use the same value")
    return ""


def read_variable(environ, suffix):
    """Return (variable name, text) of MPITRAIN_<suffix>, else HOROVOD_<suffix>."""
    for prefix in ("MPITRAIN_", "HOROVOD_"):
        name = prefix + suffix
        if name in environ:
            return name, environ[name]
    return None, None


def from_environ(environ=None):
    """Build the Config from the environment; a bad value is a ValueError."""
    environ = os.environ if environ is None else environ
    values = {}
    for field, (suffix, parse, accepts) in _VARIABLES.items():
        name, text = read_variable(environ, suffix)
        if name is None:
            continue
        try:
            values[field] = parse(text)
        except ValueError:
            raise ValueError(
                f"{name}={text!r} is not valid: it accepts {accepts}") from None
    return Config(**values, explicit=frozenset(values))


def variable_names():
    """The MPITRAIN_* names this module reads, for documentation and tests."""
    return ["MPITRAIN_" + suffix for suffix, _, _ in _VARIABLES.values()]
