"""The route table: every group a set may meet has a route that takes it, a
device buffer never meets a host-only reducer, and under mpirun the ranks take
one route even where their own tensors differ (layouts, a joined rank)."""

import contextlib
import functools
import itertools
import logging

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.backends import dtypes
from mpitrain.ops import ReduceOp
from mpitrain.transport import nccl, routes
from mpitrain.transport.channel import MPI_OPS, mpi_operation
from mpitrain.transport.host import AUTO_MIN_BYTES, AUTO_STREAM_MIN_BYTES, HostRoute
from tests.mpi_harness import mpi_test

KiB, MiB = 1 << 10, 1 << 20
REDUCER = object()          # stands for a shared-memory or hierarchical reducer
HOST_ROUTES = {"none": None,
               "shared memory, auto": HostRoute(REDUCER, AUTO_MIN_BYTES,
                                                stream_min_bytes=AUTO_STREAM_MIN_BYTES),
               "shared memory or hierarchical, every size": HostRoute(REDUCER, 0)}
# The routes that can take a device buffer: they read device memory, or copy it first.
READ_DEVICE_MEMORY = (routes.ONE_RANK, routes.ADASUM, routes.NCCL, routes.CUDA_AWARE,
                      routes.STAGED)


def every_group():
    """Every group the executor can make: each dtype with each op and scaling
    (which give its wire type), on the host or a device, of a few sizes."""
    return {routes.Group(on_device, dtypes.wire(dtype, op, prescale, 1.0), op, nbytes,
                         streamed and not on_device)
            for dtype, op, prescale, on_device, nbytes, streamed in itertools.product(
                dtypes.BY_CODE, ReduceOp, (1.0, 0.5), (False, True),
                (0, 4 * KiB, MiB, 16 * MiB), (False, True))}


def every_offer():
    """Every set: one rank or more, job-wide (blocking, with the job's host
    route) or not, with or without NCCL, CUDA-aware MPI, the one-rank setting."""
    for ranks, blocking, host, nccl_types, aware, pipeline in itertools.product(
            (1, 2, 3), (True, False), HOST_ROUTES, (frozenset(), nccl.DTYPES),
            (False, True), (False, True)):
        if blocking or host == "none":            # only the job-wide set has one
            yield routes.Offer(ranks, blocking, HOST_ROUTES[host], nccl_types, aware,
                               pipeline)


@functools.lru_cache(None)
def every_choice():
    """(group, offer, the table's choice) for every group on every set."""
    offers = list(every_offer())
    return [(group, offer, routes.choose(group, offer))
            for group in every_group() for offer in offers]


def test_every_group_on_every_set_gets_a_route_that_takes_it():
    for group, offer, choice in every_choice():
        route = choice.route
        assert route.takes(group, offer), (group, offer, choice)
        if group.on_device:
            assert route in READ_DEVICE_MEMORY, ("a device buffer on a host route",
                                                 group, offer, choice)
        else:
            assert route not in (routes.NCCL, routes.CUDA_AWARE, routes.STAGED), \
                (group, offer, choice)
        if route is routes.STAGED:
            copy = routes.Group(False, group.wire, group.op, group.nbytes)
            assert choice.host_leg in (routes.HOST_REDUCER, routes.MPI), (group, offer)
            assert choice.host_leg.takes(copy, offer), (group, offer, choice)
        else:
            assert choice.host_leg is None, (group, offer, choice)
        assert choice.streams == (route is routes.HOST_REDUCER and group.streamed), \
            (group, offer, choice)
    assert len(every_choice()) > 20_000


def test_what_each_route_needs_holds_for_every_group_it_gets():
    """Facts about MPI, NCCL and the set, checked apart from the table's own rules."""
    for group, offer, choice in every_choice():
        route = choice.route
        moves = offer.ranks > 1 or offer.one_rank_pipeline
        assert (route is routes.ONE_RANK) == (not moves), (group, offer, choice)
        if moves:
            assert (route is routes.ADASUM) == (group.op == ReduceOp.ADASUM), \
                (group, offer, choice)
        if route is routes.NCCL:
            assert group.wire in offer.nccl_types, (group, offer)
            # NCCL's Min and Max of floats may drop a NaN that numpy's keep
            assert not (group.op in (ReduceOp.MIN, ReduceOp.MAX)
                        and group.wire.kind == "f"), (group, offer)
        if route is routes.CUDA_AWARE:
            # MPI reads device memory: only with its own operation, not numpy's,
            # and only in the blocking calls of the job-wide set
            assert offer.cuda_aware and offer.blocking, (group, offer)
            assert mpi_operation(group.op, group.wire) is MPI_OPS[group.op], (group, offer)
        if route is routes.HOST_REDUCER:
            assert offer.host_route is not None and not group.on_device, (group, offer)


def test_cuda_aware_mpi_takes_device_buffers_of_every_size_instead_of_shared_memory():
    """Issue 27: a CUDA-aware job on one node sent device buffers of 4 MiB and
    more to the shared-memory reducer, which reads host memory only."""
    job = routes.Offer(2, True, HOST_ROUTES["shared memory, auto"], cuda_aware=True)
    for nbytes in (4 * KiB, 12 * MiB, 256 * MiB):
        for op in (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.PRODUCT):
            group = routes.Group(True, np.dtype(np.float32), op, nbytes)
            assert routes.choose(group, job).route is routes.CUDA_AWARE
    # MPI's operations of numpy's read host memory: Min of floats is staged
    min_of_floats = routes.Group(True, np.dtype(np.float32), ReduceOp.MIN, 12 * MiB)
    assert routes.choose(min_of_floats, job) == routes.Choice(routes.STAGED,
                                                              routes.HOST_REDUCER)
    # a process set's non-blocking calls take no device memory in Open MPI
    other_set = routes.Offer(2, False, cuda_aware=True)
    sum_of_floats = routes.Group(True, np.dtype(np.float32), ReduceOp.SUM, 12 * MiB)
    assert routes.choose(sum_of_floats, other_set) == routes.Choice(routes.STAGED,
                                                                    routes.MPI)


def test_the_one_rank_setting_sends_one_rank_through_every_device_route():
    alone = {"ranks": 1, "blocking": True, "one_rank_pipeline": True}
    group = routes.Group(True, np.dtype(np.float32), ReduceOp.SUM, MiB)
    assert routes.choose(group, routes.Offer(**alone, nccl_types=nccl.DTYPES)).route \
        is routes.NCCL
    assert routes.choose(group, routes.Offer(**alone, cuda_aware=True)).route \
        is routes.CUDA_AWARE
    assert routes.choose(group, routes.Offer(**alone)) == routes.Choice(routes.STAGED,
                                                                        routes.MPI)
    plain = routes.Offer(1, True, nccl_types=nccl.DTYPES, cuda_aware=True)
    assert routes.choose(group, plain).route is routes.ONE_RANK


# -- under mpirun: the ranks take one route whatever their own tensors are ---------

@contextlib.contextmanager
def routes_logged():
    """The routes the engine says it takes (debug records), as a list of lines."""
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("mpitrain")
    handler, level = Collect(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@mpi_test(np=(2, 3))
def test_a_joined_rank_and_a_lone_tensor_between_the_streaming_and_shared_memory_sizes():
    # The joined rank fused its zeros and streamed them through shared memory
    # while the others sent the lone tensor to MPI's allreduce: the job hung.
    r, n = mt.rank(), mt.size()
    values = [np.arange(256 * KiB, dtype=np.float32) % 97 + k for k in range(n)]    # 1 MiB
    if r == n - 1:
        mt.join()
        return
    result = mt.allreduce(values[r], op=mt.Sum, name="one.mib")
    np.testing.assert_array_equal(result, np.sum(values[:-1], axis=0))
    mt.join()


@mpi_test(np=(2, 3))
def test_one_rank_with_transposed_tensors_and_the_others_contiguous():
    # The contiguous ranks streamed their fused group through shared memory,
    # the transposed rank packed it and sent it to MPI's allreduce: the job hung.
    r, n = mt.rank(), mt.size()
    inputs = [[np.arange(160 * 160, dtype=np.float32).reshape(160, 160) % 89 + k * i
               for i in range(4)] for k in range(n)]                  # 4 x 100 KiB
    mine = [x.T.copy().T if r == 1 else x for x in inputs[r]]     # same values, F order
    assert r != 1 or not mine[0].flags.c_contiguous
    for i, result in enumerate(mt.grouped_allreduce(mine, op=mt.Sum, name="t")):
        np.testing.assert_array_equal(result, np.sum([inputs[k][i] for k in range(n)],
                                                     axis=0))


@mpi_test(np=(2,), env={"MPITRAIN_INTRA_NODE": "auto"})
def test_host_groups_take_shared_memory_from_its_sizes_up_and_mpi_below():
    r, n = mt.rank(), mt.size()
    with routes_logged() as lines:
        small = mt.allreduce(np.full(16 * KiB, r, np.float32), op=mt.Sum, name="small")
        large = mt.allreduce(np.full(2 * MiB, r, np.float32), op=mt.Sum, name="large")
        fused = mt.grouped_allreduce([np.full(64 * KiB, r + i, np.float32)
                                      for i in range(4)], op=mt.Sum, name="fused")  # 1 MiB
    assert (small == sum(range(n))).all() and (large == sum(range(n))).all()
    assert all((f == sum(range(n)) + n * i).all() for i, f in enumerate(fused))
    said = "\n".join(lines)
    assert "reduces 'small' (host float32 sum) by MPI" in said, said
    assert "reduces 'large' (host float32 sum) by host reducer" in said, said
    assert "reduces 'fused_0of4', 'fused_1of4', 'fused_2of4' and 1 more (host float32 " \
           "sum) by host reducer" in said, said


@mpi_test(np=(1,), env={"MPITRAIN_TEST_ONE_RANK_PIPELINE": "1"})
def test_the_one_rank_setting_moves_a_host_allreduce_through_mpi():
    x = np.arange(10, dtype=np.float32)
    with routes_logged() as lines:
        assert mt.synchronize(mt.allreduce_async(x, name="in.place", output=x)) is x
    np.testing.assert_array_equal(x, np.arange(10, dtype=np.float32))
    assert any("reduces 'in.place' (host float32 average) by MPI" in line
               for line in lines), lines


@mpi_test(np=(1,))
def test_one_rank_moves_nothing_by_default():
    x = np.arange(10, dtype=np.float32)
    with routes_logged() as lines:
        assert mt.synchronize(mt.allreduce_async(x, name="in.place", output=x)) is x
    assert any("reduces 'in.place' (host float32 average) by one rank" in line
               for line in lines), lines


def test_the_one_rank_setting_is_read_from_the_environment():
    from mpitrain.runtime import config
    assert config.from_environ({"MPITRAIN_TEST_ONE_RANK_PIPELINE": "1"}).test_one_rank_pipeline
    assert not config.from_environ({}).test_one_rank_pipeline
    with pytest.raises(ValueError, match="MPITRAIN_TEST_ONE_RANK_PIPELINE"):
        config.from_environ({"MPITRAIN_TEST_ONE_RANK_PIPELINE": "always"})
