"""How one process set moves device buffers: NCCL, CUDA-aware MPI, or through host memory.

The route table (mpitrain.transport.routes) picks one for each group; this
module carries it out. The job's Plan (mpitrain.transport.selection) says
whether to use NCCL. The set's communicator is made at its first device
allreduce, which every member runs in the same round; there the ranks first
check that each reduces on a GPU of its own, as NCCL requires. Where NCCL
cannot start, the setting decides: ``nccl`` fails the set's device operations
on every rank, with the reason; ``auto`` moves them through MPI instead, and
says so once.

Staging through host memory is pipelined: every chunk's copy to pinned host
memory is queued at once, MPI reduces a chunk as soon as its copy is done,
and the reduced chunk's copy back is queued while MPI takes the next.
"""

import logging

import numpy as np

from mpitrain.errors import GpuError
from mpitrain.transport import nccl, routes
from mpitrain.transport.chunk_io import ChunkIO
from mpitrain.transport.nccl import NcclAllreduce

log = logging.getLogger("mpitrain")


class DeviceTransport:
    def __init__(self, plan, node, set_id, one_rank_pipeline=False):
        self.plan = plan
        self.cuda_aware = plan is not None and plan.cuda_aware   # every rank's MPI
        self.node = node                  # which host this rank is on (a job rank)
        self.set_id = set_id
        # MPITRAIN_TEST_ONE_RANK_PIPELINE: a set of one rank moves its buffers too
        self.one_rank_pipeline = one_rank_pipeline
        self.nccl = None                  # the set's NcclAllreduce, once made
        self.broken = ""                  # why the set's device operations fail
        self._untried = plan is not None and plan.nccl

    def needs_setup(self, channel):
        return self._untried and (channel.size > 1 or self.one_rank_pipeline)

    def nccl_types(self):
        """The dtypes the set's NCCL communicator reduces (none before it is made)."""
        return frozenset() if self.nccl is None else nccl.DTYPES

    def set_up(self, channel, backend):
        """Make the set's NCCL communicator: every member, in the same round."""
        self._untried = False
        places = yield from channel.allgather_objects((self.node, backend.bus_id))
        shared = _shared_gpus(places)
        if shared:
            self._without_nccl(
                channel, shared + ", and NCCL needs a GPU for each rank",
                "give each rank a GPU of its own (torch.cuda.set_device(hvd.local_rank()), "
                "or cupy.cuda.Device(hvd.local_rank()).use(), before creating tensors), or ")
            return
        identity, problem = None, ""
        if channel.rank == 0:
            try:
                identity = nccl.unique_id()
            except Exception as error:
                problem = f"{type(error).__name__}: {error}"
        identity, problem = yield from channel.bcast_object((identity, problem))
        if problem:
            self._without_nccl(channel, f"NCCL could not start on rank 0: {problem}")
            return
        try:
            with backend.active():
                self.nccl = NcclAllreduce(identity, channel.rank, channel.size,
                                          backend.device)
            problem = ""
        except Exception as error:
            problem = f"{type(error).__name__}: {error}"
        problems = yield from channel.allgather_objects(problem)
        if any(problems):
            self.nccl = None
            self._without_nccl(channel, "NCCL could not start (" + "; ".join(
                f"rank {rank}: {why}" for rank, why in enumerate(problems) if why) + ")")

    def _without_nccl(self, channel, why, remedy=""):
        if self.plan.setting == "nccl":
            advice = remedy + "use MPITRAIN_GPU_OPERATIONS=mpi"
            self.broken = (f"MPITRAIN_GPU_OPERATIONS=nccl cannot work: {why}. "
                           f"{advice[0].upper()}{advice[1:]}")
        elif channel.rank == 0:
            log.warning("mpitrain: %s; device allreduces of process set %d go through "
                        "%s instead", why, self.set_id,
                        "CUDA-aware MPI" if self.cuda_aware
                        else "MPI, staged through pinned host memory")

    def check(self, backend):
        """Raise why this set cannot reduce buffers of ``backend`` now."""
        if self.broken:
            raise GpuError(self.broken)
        if self.nccl is not None and self.nccl.device != backend.device:
            raise GpuError(
                f"this process set's NCCL communicator is on GPU {self.nccl.device}, "
                f"but the tensor is on GPU {backend.device}: keep a rank's tensors "
                "on one GPU")

    def allreduce(self, choice, buffer, op, channel, backend):
        """Reduce a contiguous 1-D device buffer in place across the set, by
        the device route of ``choice`` (routes.choose)."""
        if choice.route is routes.NCCL:
            with backend.active():
                self.nccl.allreduce(buffer, op, backend.stream)
        elif choice.route is routes.CUDA_AWARE:
            backend.settle()             # MPI reads device memory: it must be ready
            yield from channel.allreduce(buffer, op)
        else:
            yield from _staged(buffer, op, channel, backend, choice.host_leg)


def _staged(buffer, op, channel, backend, host_leg):
    host = backend.pinned(buffer.dtype, buffer.size)
    copies = [backend.download(buffer[start:stop], host[start:stop])
              for start, stop in channel.chunks(buffer.size, buffer.itemsize)]
    yield from routes.host_allreduce(
        host_leg, channel, host, op,
        _Staged(buffer, host, copies, channel.chunk_elements(buffer.itemsize), backend))


class _Staged(ChunkIO):
    """A device buffer's chunks through pinned host memory: each chunk waits
    for its download before it travels and is uploaded once reduced."""

    fills = True

    def __init__(self, buffer, host, copies, step, backend):
        self.buffer = buffer
        self.host = host
        self.copies = copies            # the downloads, one per step elements
        self.step = step
        self.backend = backend

    def fill(self, start, stop, destination):
        # The channel's route may travel in other pieces than the copies.
        for copy in self.copies[start // self.step:(stop - 1) // self.step + 1]:
            copy.synchronize()
        if not np.shares_memory(destination, self.host):   # shared memory: copy on
            np.copyto(destination, self.host[start:stop])

    def reduced(self, start, stop):
        self.backend.upload(self.host[start:stop], self.buffer[start:stop])


def _shared_gpus(places):
    """Which ranks reduce on one GPU, from every rank's (node, PCI bus id); "" if none."""
    ranks_of = {}
    for rank, place in enumerate(places):
        ranks_of.setdefault(place, []).append(rank)
    return "; ".join(f"ranks {', '.join(map(str, ranks))} all reduce on GPU {bus_id}"
                     for (_, bus_id), ranks in ranks_of.items() if len(ranks) > 1)
