"""Which allreduces of a round share one call: the fusion plan (no MPI needed:
the plan is a function of the responses and the set's route alone)."""

import numpy as np

from mpitrain.backends import dtypes
from mpitrain.engine.execution import fusion
from mpitrain.engine.negotiation.messages import Response
from mpitrain.ops import OpType, ReduceOp

MiB = 1 << 20
FLOAT32 = dtypes.lookup(np.dtype(np.float32)).code


def allreduce(name, nbytes, device=-1):
    return Response(OpType.ALLREDUCE, name, FLOAT32, (nbytes // 4,), ReduceOp.SUM,
                    device=device)


def names(groups):
    return [group.names for group in groups]


def test_large_tensors_go_alone_where_the_set_does_not_stream():
    round_ = [allreduce("big", MiB), allreduce("a", 1024), allreduce("b", 2048)]
    assert names(fusion.plan(round_, 64 * MiB)) == [["big"], ["a", "b"]]


def test_large_host_tensors_fuse_into_groups_that_stream():
    round_ = [allreduce(f"big{i}", MiB) for i in range(6)] + [allreduce("a", 1024)]
    plan = fusion.plan(round_, 64 * MiB, streams_from=4 * MiB)
    assert names(plan) == [[f"big{i}" for i in range(6)] + ["a"]]
    # within the fusion threshold still
    assert names(fusion.plan(round_, 3 * MiB, streams_from=0)) == [
        ["big0", "big1", "big2"], ["big3", "big4", "big5"], ["a"]]


def test_groups_too_small_to_stream_send_their_large_tensors_alone():
    round_ = [allreduce("a", 1024), allreduce("big0", MiB), allreduce("b", 1024),
              allreduce("big1", MiB)]
    assert names(fusion.plan(round_, 64 * MiB, streams_from=4 * MiB)) == [
        ["big0"], ["big1"], ["a", "b"]]


def test_large_tensors_that_cannot_stream_go_alone_where_the_set_streams():
    """Integer sums are scaled once the whole sum is in, and Adasum combines
    each tensor on its own: neither streams, so neither joins large groups."""
    integers = dtypes.lookup(np.dtype(np.int64)).code
    round_ = [Response(OpType.ALLREDUCE, f"int{i}", integers, (MiB // 8,), ReduceOp.SUM)
              for i in range(6)]
    round_ += [Response(OpType.ALLREDUCE, f"adasum{i}", FLOAT32, (MiB // 4,),
                        ReduceOp.ADASUM) for i in range(6)]
    assert names(fusion.plan(round_, 64 * MiB, streams_from=0)) == [
        [f"int{i}"] for i in range(6)] + [[f"adasum{i}"] for i in range(6)]


def test_device_tensors_never_stream_through_host_memory():
    round_ = [allreduce(f"gpu{i}", MiB, device=0) for i in range(6)]
    assert names(fusion.plan(round_, 64 * MiB, streams_from=0)) == [
        [f"gpu{i}"] for i in range(6)]
