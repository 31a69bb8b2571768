"""Process sets: static, dynamic, membership errors, concurrent use."""

import numpy as np
import pytest

import mpitrain as mt
from tests.mpi_harness import mpi_test, on_a_new_process_set


@mpi_test(np=(3,), init=False)
def test_static_sets_from_init():
    evens, odds = mt.ProcessSet([0, 2]), mt.ProcessSet([1])
    mt.init(process_sets=[evens, odds])
    r = mt.rank()
    assert evens.process_set_id == 1 and odds.process_set_id == 2
    assert evens.size() == 2 and evens.included() == (r in (0, 2))
    if r in (0, 2):
        assert evens.rank() == (0 if r == 0 else 1)
        got = mt.allreduce(np.full(2, float(r)), op=mt.Sum, process_set=evens)
        np.testing.assert_array_equal(got, [2.0, 2.0])
        assert mt.allgather(np.full(1, r), process_set=evens).tolist() == [0, 2]
        # root_rank is a rank of the job, as in Horovod: 2, the set's second member
        assert mt.broadcast(np.full(1, r), root_rank=2, process_set=evens)[0] == 2
    else:
        with pytest.raises(ValueError, match="not a member"):
            mt.allreduce(np.ones(1), process_set=evens)
        with pytest.raises(ValueError, match="not a member"):
            evens.rank()
    assert mt.allreduce(np.ones(1), op=mt.Sum)[0] == 3
    mt.shutdown()


@mpi_test(init=False)
def test_sets_from_the_parts_of_an_mpi4py_split():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    part = world.Split(color=world.rank % 2, key=world.rank)
    mine = mt.ProcessSet(part)
    mt.init(process_sets=[mine])
    r, n = mt.rank(), mt.size()
    members = [k for k in range(n) if k % 2 == r % 2]
    assert mine.ranks == members and mine.rank() == members.index(r)
    got = mt.allreduce(np.full(2, float(r)), op=mt.Sum, process_set=mine, name="part")
    np.testing.assert_array_equal(got, [sum(members)] * 2)
    # Every part is registered on every rank, in the order of the ranks.
    assert mine.process_set_id == 1 + r % 2
    with pytest.raises(ValueError, match="already registered"):
        mt.add_process_set([k for k in range(n) if k % 2 != r % 2] or [0])
    mt.shutdown()
    part.Free()


@mpi_test(np=(3,), init=False)
def test_sets_that_disagree_or_do_not_fit_fail_init_on_every_rank():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    evens_and_odds = world.Split(color=world.rank % 2)       # [0, 2] and [1]
    low_and_high = world.Split(color=int(world.rank == 2))   # [0, 1] and [2]
    part = evens_and_odds if world.rank == 0 else low_and_high
    with pytest.raises(ValueError, match=r"agree on who is in them.*rank 0: \[\[0, 2\]\]"):
        mt.init(process_sets=[mt.ProcessSet(part)])
    assert not mt.is_initialized()
    with pytest.raises(ValueError, match="same sets on every rank"):
        mt.init(process_sets=[[0, 1]] if world.rank == 0 else None)
    assert not mt.is_initialized()
    beyond_the_job = [0, 99] if world.rank == 0 else [0, 1]
    with pytest.raises(ValueError, match="failed on rank 0: .*beyond the job's 3 ranks"):
        mt.init(process_sets=[beyond_the_job])
    assert not mt.is_initialized()
    with pytest.raises(ValueError, match="COMM_NULL"):
        mt.ProcessSet(MPI.COMM_NULL)
    evens_and_odds.Free()
    low_and_high.Free()


@mpi_test(np=(3,))
def test_dynamic_add_use_and_remove():
    r, n = mt.rank(), mt.size()
    pair = mt.add_process_set([0, 1])
    assert pair.process_set_id is not None and pair.size() == 2
    if r < 2:
        for step in range(5):
            got = mt.allreduce(np.full(3, float(r + step)), op=mt.Sum, process_set=pair,
                               name="pair.grad")
            np.testing.assert_array_equal(got, np.full(3, 1.0 + 2 * step))
        mt.barrier(process_set=pair)
    with pytest.raises(ValueError, match="already registered"):
        mt.add_process_set([0, 1])
    assert mt.remove_process_set(pair)
    assert pair.process_set_id is None
    with pytest.raises(ValueError, match="not registered"):
        mt.allreduce(np.ones(1), process_set=pair)
    with pytest.raises(ValueError, match="cannot be removed"):
        mt.remove_process_set(mt.global_process_set)
    # One rank's bad removal fails the removal on every rank.
    pair = mt.add_process_set([0, 1])
    with pytest.raises(ValueError, match="failed on rank 2: .*is not registered"):
        mt.remove_process_set(pair if r != 2 else mt.ProcessSet([0, 1]))
    assert mt.remove_process_set(pair)
    assert mt.allreduce(np.ones(1), op=mt.Sum)[0] == n


OUTSIDER = r"root_rank 0 is not a member of the process set, whose ranks are \[1, 2\]"


def broadcast_on_the_set_of_ranks_1_and_2(r, upper):
    got = mt.broadcast(np.full(2, 10.0 * r), root_rank=2, process_set=upper)
    np.testing.assert_array_equal(got, [20.0, 20.0])
    into = np.full(3, float(r))
    mt.synchronize(mt.broadcast_async(into, 1, process_set=upper, output=into))
    np.testing.assert_array_equal(into, [1.0, 1.0, 1.0])
    assert mt.broadcast_object({"from": r}, 2, process_set=upper) == {"from": 2}
    with pytest.raises(ValueError, match=rf"broadcast of 'outsider' failed.*{OUTSIDER}"):
        mt.broadcast(np.ones(2), root_rank=0, name="outsider", process_set=upper)
    with pytest.raises(ValueError, match=OUTSIDER):
        mt.broadcast_object("epoch 1", root_rank=0, process_set=upper)
    with pytest.raises(ValueError, match="root_rank 3 is out of range for a job of 3"):
        mt.broadcast(np.ones(2), root_rank=3, process_set=upper)
    # Only rank 1 names the outsider: rank 2, which named itself, hears why.
    with pytest.raises(ValueError, match=OUTSIDER):
        mt.broadcast(np.ones(2), root_rank=0 if r == 1 else 2, name="one.outsider",
                     process_set=upper)
    assert mt.allreduce(np.ones(1), op=mt.Sum, process_set=upper)[0] == 2


@mpi_test(np=(3,))
def test_a_broadcast_root_on_a_set_is_a_rank_of_the_job():
    """As in Horovod: on the set {1, 2}, root_rank=2 is the job's rank 2, and
    rank 0, outside the set, fails on every member."""
    on_a_new_process_set((1, 2), broadcast_on_the_set_of_ranks_1_and_2)


@mpi_test(np=(3,))
def test_overlapping_sets_used_at_the_same_time_do_not_deadlock():
    r = mt.rank()
    first, second = mt.add_process_set([0, 1]), mt.add_process_set([1, 2])
    handles = []
    for step in range(20):
        # rank 1 is in both sets and submits to them in opposite orders
        sets = [s for s in (first, second) if s.included()]
        if r == 1 and step % 2:
            sets.reverse()
        for s in sets:
            handles.append((s, mt.allreduce_async(np.full(100, 1.0), op=mt.Sum,
                                                  process_set=s, name=f"s{step}")))
        handles.append((None, mt.allreduce_async(np.ones(10), op=mt.Sum, name=f"g{step}")))
    for s, handle in handles:
        assert mt.synchronize(handle)[0] == (3 if s is None else 2)
    mt.remove_process_set(first)
    mt.remove_process_set(second)


@mpi_test(np=(3,))
def test_mismatched_dynamic_sets_fail_on_every_rank():
    with pytest.raises(mt.MismatchError, match="process sets.*rank 0: \\[0, 1\\]"):
        mt.add_process_set([0, 1] if mt.rank() == 0 else [0, 2])
    assert mt.allreduce(np.ones(1), op=mt.Sum)[0] == mt.size()


@mpi_test()
def test_a_bad_set_on_one_rank_fails_every_rank():
    ranks = [0, 1] if mt.rank() == 0 else [0]       # [0, 1] repeats the job-wide set at np 2
    if mt.size() > 2:
        ranks = [0, 99] if mt.rank() == 0 else [0]
    with pytest.raises(ValueError, match="failed on rank 0"):
        mt.add_process_set(ranks)
    assert mt.allreduce(np.ones(1), op=mt.Sum)[0] == mt.size()
