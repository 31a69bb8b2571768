"""The coordinator's validation, the response cache and the control vector."""

import numpy as np

from mpitrain.backends import dtypes
from mpitrain.engine.negotiation import control_vector
from mpitrain.engine.negotiation.cache import HIT, INVALID, MISS, ResponseCache
from mpitrain.engine.negotiation.coordinator import Coordinator
from mpitrain.engine.handles import signature
from mpitrain.engine.negotiation.messages import Request
from mpitrain.ops import OpType, Sum

FLOAT32 = dtypes.lookup(np.dtype(np.float32)).code


def request(rank, name="w", shape=(2, 3), kind=OpType.ALLREDUCE, **fields):
    return Request(name, kind, rank, FLOAT32, shape, Sum, **fields)


def test_a_name_is_ready_once_every_rank_submitted_it():
    coordinator = Coordinator(3)
    assert coordinator.receive([[request(0)], [], [request(2)]], now=0.0) == []
    assert set(coordinator.waiting()["w"][1]) == {0, 2}
    [response] = coordinator.receive([[], [request(1)], []], now=1.0)
    assert response.kind == OpType.ALLREDUCE and response.shape == (2, 3)
    assert coordinator.waiting() == {}


def test_mismatches_become_error_responses_that_name_every_rank():
    coordinator = Coordinator(3)
    [response] = coordinator.receive(
        [[request(0)], [request(1, shape=(3, 3))], [request(2, shape=(3, 3))]], now=0)
    assert response.kind == OpType.ERROR and response.error_kind == "mismatch"
    assert "'w'" in response.error
    assert "rank 0: (2, 3); ranks 1, 2: (3, 3)" in response.error


def test_allgather_collects_each_ranks_first_dimension():
    coordinator = Coordinator(2)
    [response] = coordinator.receive(
        [[request(0, kind=OpType.ALLGATHER, shape=(1, 4))],
         [request(1, kind=OpType.ALLGATHER, shape=(3, 4))]], now=0)
    assert response.first_dims == (1, 3) and response.shape == (4,)


def test_joined_ranks_complete_allreduces_and_the_last_join_completes_join():
    coordinator = Coordinator(2)
    join = Request("join", OpType.JOIN, 0)
    assert coordinator.receive([[join], []], now=0) == []
    [response] = coordinator.receive([[], [request(1)]], now=0)
    assert response.kind == OpType.ALLREDUCE
    [done] = coordinator.receive([[], [Request("join", OpType.JOIN, 1)]], now=0)
    assert done.kind == OpType.JOIN and done.last_joined_rank == 1


def test_cache_hits_invalidates_and_evicts_least_recently_used():
    cache = ResponseCache(2)
    first, second, third = (Coordinator(1).receive([[request(0, name=n)]], 0)[0]
                            for n in "abc")
    sig = signature(OpType.ALLREDUCE, FLOAT32, (2, 3), Sum, 1.0, 1.0, -1)
    cache.put(first, sig)
    cache.put(second, sig)
    assert cache.lookup("a", sig) == (HIT, 0)
    other = signature(OpType.ALLREDUCE, FLOAT32, (9,), Sum, 1.0, 1.0, -1)
    assert cache.lookup("a", other) == (INVALID, 0)
    cache.touch([0])                               # "b" is now least recently used
    cache.put(third, sig)
    assert cache.lookup("b", sig) == (MISS, None)
    assert cache.lookup("c", sig) == (HIT, 1)


def test_control_vector_round_trip():
    nbits = 130
    vector = control_vector.encode(control_vector.UNCACHED, ready=0b1011 | 1 << 129,
                            invalid=1 << 64, submitted=0b11, nbits=nbits)
    status, ready, invalid, submitted = control_vector.decode(vector, nbits)
    assert status == control_vector.UNCACHED and ready == 0b1011 | 1 << 129
    assert invalid == 1 << 64 and submitted == 0b11
    assert list(control_vector.bits(ready)) == [0, 1, 3, 129]
    # AND across two ranks: "every rank" sets intersect, "some rank" sets unite
    other = control_vector.encode(control_vector.SHUTDOWN, ready=0b0011, invalid=1,
                                  submitted=0b100, nbits=nbits)
    status, ready, invalid, submitted = control_vector.decode(vector & other, nbits)
    assert status == control_vector.UNCACHED | control_vector.SHUTDOWN
    assert ready == 0b0011 and invalid == 1 << 64 | 1 and submitted == 0b111
