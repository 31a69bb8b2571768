"""The process groups the torch.distributed tests share in one mpirun job.

Every test body of a job runs in the same processes: the default group
("mpitrain", started as a user would, with nothing set) and a gloo group of
all ranks, the reference, are made once.
"""

import functools

import torch.distributed as dist

import mpitrain.torch  # noqa: F401  (registers the "mpitrain" backend)


def mpitrain_group():
    """The default group: init_process_group("mpitrain"), with no address, rank or size."""
    if not dist.is_initialized():
        dist.init_process_group("mpitrain")
    return dist.group.WORLD


@functools.lru_cache(None)
def gloo_group():
    """gloo on every rank of the job, built on the store mpitrain's start made."""
    mpitrain_group()
    return dist.new_group(backend="gloo")
