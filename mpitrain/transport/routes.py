"""The route table: which route reduces a group of allreduces, decided from what every rank knows.

As Horovod's list of operations, each with its Enabled(): ROUTES is ordered, and
the first route that takes a group reduces it. Each route states what it takes:
where the buffers live (host memory or a CUDA device), the wire dtype, the op,
the process set (its size; only the job-wide set blocks and has a host reducer),
the bytes, and what the set's transports offer (the host reducer, NCCL, a
CUDA-aware MPI on every rank). A host-only route is never offered a device
buffer, so a device buffer cannot reach shared memory or the hierarchical
reducer, which read host memory only.

Every fact is alike on every rank: a group's responses come from the
coordinator; the set's size, the job's host route and device plan were agreed at
init; the set's NCCL communicator is agreed on when it is made. What only one
rank knows (its tensors' strides, that it joined and has no tensor) decides how
its data enters and leaves the chosen route, never the route: ranks on
different routes would make different MPI calls and wait for each other forever.
"""

import dataclasses

import numpy as np

from mpitrain.ops import ReduceOp
from mpitrain.transport.channel import numpy_operation, propagates_nan

HOST, DEVICE, EITHER = "host", "device", "either"


@dataclasses.dataclass(frozen=True)
class Group:
    """What every rank knows of a group of allreduces."""

    on_device: bool          # its buffers live on a CUDA device
    wire: np.dtype           # the type it is reduced in (mpitrain.backends.dtypes.wire)
    op: ReduceOp
    nbytes: int              # of its buffer
    streamed: bool = False   # fused host tensors that may stream (mpitrain.engine.execution.streaming)


@dataclasses.dataclass(frozen=True)
class Offer:
    """What a process set's transports offer, alike on every member."""

    ranks: int
    blocking: bool                   # the job-wide set: blocking MPI calls
    host_route: object = None        # the job's transport.host.HostRoute (job-wide set only)
    nccl_types: frozenset = frozenset()   # dtypes the set's NCCL communicator reduces
    cuda_aware: bool = False         # every rank's MPI reads device memory
    one_rank_pipeline: bool = False  # MPITRAIN_TEST_ONE_RANK_PIPELINE: one rank moves data too


@dataclasses.dataclass(frozen=True)
class Route:
    name: str
    buffers: str             # HOST, DEVICE or EITHER: where the buffers it takes live
    accepts: object          # accepts(group, offer): what else it needs
    how: str                 # what it does, for logs

    def takes(self, group, offer):
        return (self.buffers in (EITHER, DEVICE if group.on_device else HOST)
                and self.accepts(group, offer))


ONE_RANK = Route(
    "one rank", EITHER, lambda group, offer: offer.ranks == 1 and not offer.one_rank_pipeline,
    "nothing to move: the process set has one rank")
ADASUM = Route(
    "Adasum", EITHER, lambda group, offer: group.op == ReduceOp.ADASUM,
    "Adasum over MPI in host memory (device buffers are copied there and back)")
NCCL = Route(
    # NCCL's Min and Max of floats may drop a NaN (CUDA's fminf and fmaxf do);
    # numpy's, which the host applies, keep it
    "NCCL", DEVICE, lambda group, offer: (group.wire in offer.nccl_types
                                          and not propagates_nan(group.op, group.wire)),
    "NCCL's allreduce on the engine's stream")
CUDA_AWARE = Route(
    # Open MPI takes device memory in blocking collectives only, and an operation
    # of numpy's (mpitrain.transport.channel.mpi_operation) reads host memory only.
    "CUDA-aware MPI", DEVICE, lambda group, offer: (
        offer.cuda_aware and offer.blocking and not numpy_operation(group.op, group.wire)),
    "MPI's allreduce on device memory")
STAGED = Route(
    "staged", DEVICE, lambda group, offer: True,
    "copied to pinned host memory and back, pipelined in chunks")
HOST_REDUCER = Route(
    "host reducer", HOST, lambda group, offer: (
        offer.host_route is not None
        and offer.host_route.takes(group.nbytes, streamed=group.streamed)),
    "shared memory inside a node, or hierarchical across nodes")
MPI = Route("MPI", HOST, lambda group, offer: True, "MPI's allreduce")

ROUTES = (ONE_RANK, ADASUM, NCCL, CUDA_AWARE, STAGED, HOST_REDUCER, MPI)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A group's route; STAGED moves its host copy by host_leg. streams: the
    group's tensors may go through the host reducer chunk by chunk, without
    the fusion buffer (where this rank's tensors are contiguous)."""

    route: Route
    host_leg: Route = None
    streams: bool = False

    def __str__(self):
        if self.host_leg is None:
            return f"{self.route.name} ({self.route.how})"
        return (f"{self.route.name} ({self.route.how}), then {self.host_leg.name} "
                f"({self.host_leg.how})")


def choose(group, offer):
    """The Choice of the first route in ROUTES that takes ``group`` on ``offer``."""
    route = _first(group, offer)
    if route is STAGED:
        copy = dataclasses.replace(group, on_device=False, streamed=False)
        return Choice(route, host_leg=_first(copy, offer))
    return Choice(route, streams=route is HOST_REDUCER and group.streamed)


def _first(group, offer):
    return next(route for route in ROUTES if route.takes(group, offer))


def host_allreduce(route, channel, buffer, op, io):
    """Reduce the 1-D host ``buffer`` in place by the host route ``route``
    (HOST_REDUCER or MPI), its chunks in and out through io (a ChunkIO)."""
    if route is HOST_REDUCER:
        return channel.allreduce_by_host_reducer(buffer, op, io)
    return channel.allreduce(buffer, op, io)
