"""Removing a process set while operations on it are in flight.

An operation whose data already moves when the removal reaches the set
finishes (MPI is still writing its result); the others fail. Either way
every member sees the same outcome, and the job goes on.
"""

import numpy as np

import mpitrain as mt
from tests.mpi_harness import mpi_test

BIG = 20_000_000        # floats: the transfer outlasts the removal's negotiation


def outcome(handle):
    """What synchronize gave, comparable across ranks."""
    try:
        result = mt.synchronize(handle)
    except mt.HorovodInternalError as error:
        return f"{type(error).__name__}: {error}"
    return f"{float(result.min())}..{float(result.max())}"


def removed(name, set_id):
    return (f"MpitrainInternalError: allreduce of '{name}' failed: process set "
            f"{set_id} (ranks [0, 1]) was removed while it was in flight: "
            "synchronize the operations of a process set before remove_process_set")


def remove_with_operations_in_flight():
    """Every rank's outcomes, and the set's id."""
    pair = mt.add_process_set([0, 1])
    set_id = pair.process_set_id
    handles = {}
    if pair.included():
        handles["big"] = mt.allreduce_async(np.ones(BIG, np.float32), op=mt.Sum,
                                            name="big", process_set=pair)
        handles["next"] = mt.allreduce_async(np.ones(3), op=mt.Sum, name="next",
                                             process_set=pair)
        if mt.rank() == 0:        # rank 1 never submits it: it can only fail
            handles["alone"] = mt.allreduce_async(np.ones(3), name="alone",
                                                  process_set=pair)
    mt.remove_process_set(pair)
    return mt.allgather_object({name: outcome(h) for name, h in handles.items()}), set_id


@mpi_test(np=(3,), timeout=60)
def test_removing_a_set_with_operations_in_flight_fails_them_alike_and_the_job_goes_on():
    # Each removal reaches the set at another point of its round.
    attempts = [remove_with_operations_in_flight() for _ in range(8)]
    assert mt.allreduce(np.ones(1), op=mt.Sum)[0] == 3
    again, other = mt.add_process_set([0, 1]), mt.add_process_set([1, 2])
    for process_set in (again, other):
        if process_set.included():
            got = mt.allreduce(np.ones(2), op=mt.Sum, name="after", process_set=process_set)
            assert got.tolist() == [2.0, 2.0]
    mt.remove_process_set(again)
    mt.remove_process_set(other)
    for outcomes, set_id in attempts:
        assert outcomes[0]["alone"] == removed("alone", set_id), outcomes
        for name in ("big", "next"):
            assert outcomes[0][name] == outcomes[1][name], outcomes
            assert outcomes[0][name] in ("2.0..2.0", removed(name, set_id)), outcomes
