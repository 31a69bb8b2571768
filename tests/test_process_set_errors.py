"""Errors on a process set name its members by their rank in the job.

On the set {1, 2} of a 3-rank job, the set's ranks 0 and 1 are the job's
ranks 1 and 2: an error that said "rank 0" would send the user to the wrong
process. Every member raises the same message.
"""

import importlib
import sys
import types

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.errors import CollectiveTypeError, CollectiveValueError
from tests.mpi_harness import mpi_test, on_a_new_process_set


def raises_on_the_set(error, call):
    with pytest.raises(error) as caught:
        call()
    return str(caught.value)


def mismatches(r, pair):
    members = f"across process set {pair.process_set_id} (ranks [1, 2])"
    cases = [
        ("shape", lambda: mt.allreduce(np.zeros(r + 1), name="shape", process_set=pair),
         f"allreduce of 'shape' failed: mismatched shapes {members}: "
         "rank 1: (2,); rank 2: (3,)"),
        ("dtype", lambda: mt.allreduce(np.zeros(2, np.float32 if r == 1 else np.float64),
                                       name="dtype", process_set=pair),
         f"allreduce of 'dtype' failed: mismatched data types {members}: "
         "rank 1: float32; rank 2: float64"),
        ("op", lambda: mt.allreduce(np.zeros(2), op=mt.Sum if r == 1 else mt.Max,
                                    name="op", process_set=pair),
         f"allreduce of 'op' failed: mismatched reduction ops {members}: "
         "rank 1: Sum; rank 2: Max"),
        ("operation", lambda: (mt.allreduce if r == 1 else mt.allgather)(
            np.zeros(2), name="operation", process_set=pair),
         f"allreduce of 'operation' failed: mismatched operations {members}: "
         "rank 1: allreduce; rank 2: allgather"),
        ("root", lambda: mt.broadcast(np.zeros(2), root_rank=r, name="root",
                                      process_set=pair),
         f"broadcast of 'root' failed: mismatched root ranks {members}: "
         "rank 1: 1; rank 2: 2"),
    ]
    for label, call, expected in cases:
        assert raises_on_the_set(mt.MismatchError, call) == expected, label
    assert mt.allreduce(np.ones(1), op=mt.Sum, process_set=pair)[0] == 2


@mpi_test(np=(3,))
def test_mismatches_on_a_set_name_its_members_by_their_rank_in_the_job():
    on_a_new_process_set((1, 2), mismatches)


def argument_errors_of_rank_2(r, pair):
    complex_on_2 = np.zeros(2, np.complex128 if r == 2 else np.float64)
    message = raises_on_the_set(CollectiveTypeError, lambda: mt.allreduce(
        complex_on_2, name="complex", process_set=pair))
    assert message.startswith("allreduce of 'complex' failed on rank 2 of the job: "
                              "unsupported dtype complex128"), message
    message = raises_on_the_set(CollectiveValueError, lambda: mt.broadcast(
        np.zeros(2), root_rank=0 if r == 2 else 1, name="outsider", process_set=pair))
    assert message == ("broadcast of 'outsider' failed on rank 2 of the job: root_rank 0 "
                       "is not a member of the process set, whose ranks are [1, 2] "
                       "(root_rank is a rank of the job, as in Horovod)"), message
    assert mt.allreduce(np.ones(1), op=mt.Sum, process_set=pair)[0] == 2


@mpi_test(np=(3,))
def test_an_argument_error_on_one_member_names_its_rank_in_the_job_on_both():
    on_a_new_process_set((1, 2), argument_errors_of_rank_2)


class OnlyItsSenderCanLoad:
    """Unpickling imports a module that only the sending rank has."""

    def __reduce__(self):
        return importlib.import_module, (f"only_on_rank_{mt.rank()}",)


def unpicklable_objects(r, pair):
    sys.modules[f"only_on_rank_{r}"] = types.ModuleType(f"only_on_rank_{r}")
    try:
        message = raises_on_the_set(CollectiveTypeError, lambda: mt.allgather_object(
            OnlyItsSenderCanLoad(), name="gathered", process_set=pair))
    finally:
        del sys.modules[f"only_on_rank_{r}"]
    assert message == (
        "allgather_object of 'gathered' failed: "
        "on rank 1 of the job, rank 2's object cannot be unpickled here: "
        "ModuleNotFoundError: No module named 'only_on_rank_2'; "
        "on rank 2 of the job, rank 1's object cannot be unpickled here: "
        "ModuleNotFoundError: No module named 'only_on_rank_1'"), message


@mpi_test(np=(3,))
def test_objects_a_member_cannot_unpickle_name_ranks_of_the_job():
    on_a_new_process_set((1, 2), unpicklable_objects)
