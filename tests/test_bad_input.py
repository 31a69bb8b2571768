"""Bad input on the numpy core (docs/bad-input.md).

tests/test_errors.py covers allreduce and the first cases of each kind; the
cases every framework shares (mismatches, unsupported dtypes, empty,
strided and 0-d arrays, roots, splits, process sets, calls before init) are
tests/bad_input_table.py's, run here on numpy. This file tries the rest on
the core and its engine: settings, names, threads, forks, output arrays,
disagreements only the stall report ends, checking the answer on every
rank, and that the engine still works afterwards.
"""

import os
import re
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

import mpitrain as mt
from mpitrain.errors import CollectiveValueError
from tests import bad_input_table
from tests.frameworks import Numpy
from tests.mpi_harness import mpi_test
from tests.test_errors import engine_still_works, raises_everywhere

FAST_STALL = {"MPITRAIN_STALL_CHECK_TIME_SECONDS": "0.5",
              "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "2"}

# The shared cases, first in each job (the one before init() wants a fresh process).
globals().update(bad_input_table.tests_for("numpy"))


@mpi_test()
def test_an_unsupported_dtype_on_one_rank_names_that_rank_everywhere():
    n = mt.size()
    array = np.zeros((n, 2), np.complex64 if mt.rank() == n - 1 else np.float32)
    for label, call in Numpy().every_collective(array, "one.complex").items():
        message = raises_everywhere(TypeError, "unsupported dtype complex64", call)
        assert f"rank {n - 1}" in message, (label, message)
    engine_still_works()


@mpi_test()
def test_fractional_alltoall_splits_are_refused():
    n = mt.size()
    raises_everywhere(ValueError, "splits", lambda: mt.alltoall(
        np.ones((n, 1)), splits=[0.5, 1.5] + [1] * (n - 2), name="fractional"))


@mpi_test()
def test_wrong_output_arrays_fail_on_every_rank():
    def into(output):
        return lambda: mt.synchronize(mt.allreduce_async(np.ones(3), output=output))
    raises_everywhere(ValueError, "cannot hold the result", into(np.zeros(4)))
    raises_everywhere(ValueError, "cannot hold the result", into(np.zeros(3, np.int32)))
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    raises_everywhere(ValueError, "read-only", into(frozen))
    engine_still_works()


@mpi_test(init=False)
def test_bad_environment_values_fail_init_on_every_rank_and_name_the_variable():
    bad = {"MPITRAIN_FUSION_THRESHOLD": ("64MB", "bytes"),
           "HOROVOD_CYCLE_TIME": ("fast", "milliseconds"),
           "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": ("-5", "seconds >= 0"),
           "MPITRAIN_CACHE_CAPACITY": ("lots", "entries"),
           "MPITRAIN_ABORT_ON_EXCEPTION": ("maybe", "0 or 1"),
           "MPITRAIN_LOG_LEVEL": ("loud", "warning")}
    for variable, (value, accepts) in bad.items():
        os.environ[variable] = value
        try:
            with pytest.raises(ValueError) as caught:
                mt.init()
        finally:
            del os.environ[variable]
        message = str(caught.value)
        assert variable in message and repr(value) in message and accepts in message
        assert not mt.is_initialized()
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 1:             # one rank alone: the others fail too
        os.environ["MPITRAIN_FUSION_THRESHOLD"] = "64MB"
    try:
        with pytest.raises(ValueError, match="init\\(\\) failed on rank 1: "
                                             "MPITRAIN_FUSION_THRESHOLD='64MB'"):
            mt.init()
    finally:
        os.environ.pop("MPITRAIN_FUSION_THRESHOLD", None)
    assert not mt.is_initialized()
    mt.init()
    engine_still_works()
    mt.shutdown()


@mpi_test(init=False)
def test_settings_that_must_agree_but_differ_fail_init_on_every_rank():
    """Valid values that differ between ranks would pair mismatched MPI calls."""
    from mpi4py import MPI
    rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    others = ", ".join(str(r) for r in range(size) if r != 1)
    label = "ranks" if size > 2 else "rank"
    for variable, default, value in (("MPITRAIN_CHUNK_SIZE", 4194304, 1048576),
                                     ("HOROVOD_FUSION_THRESHOLD", 67108864, 1024),
                                     ("MPITRAIN_CACHE_CAPACITY", 1024, 16),
                                     ("MPITRAIN_ELASTIC_RESET_LIMIT", 3, 5),
                                     ("MPITRAIN_GPU_OPERATIONS", "auto", "mpi")):
        if rank == 1:
            os.environ[variable] = str(value)
        try:
            with pytest.raises(ValueError) as caught:
                mt.init()
        finally:
            os.environ.pop(variable, None)
        shown = "MPITRAIN_" + variable.split("_", 1)[1]
        assert str(caught.value) == (
            f"init() failed on ranks {', '.join(map(str, range(size)))}: {shown} differs "
            f"between ranks ({label} {others}: {default}; rank 1: {value}): every rank "
            "must use the same value")
        assert not mt.is_initialized()
    os.environ["MPITRAIN_CHUNK_SIZE"] = "1048576"          # the same everywhere: fine
    try:
        mt.init()
        engine_still_works()
        mt.shutdown()
    finally:
        del os.environ["MPITRAIN_CHUNK_SIZE"]


def expect_everywhere(name, call, *also):
    """The call fails with a message naming the tensor (and ``also``)."""
    with pytest.raises(mt.HorovodInternalError) as caught:
        call()
    message = str(caught.value)
    assert all(part in message for part in (name,) + also), message


def wait_until_the_job_stops(deadline=30.0):
    """For the rank whose call failed at once: the others are still waiting."""
    started = time.monotonic()
    while mt.is_initialized() and time.monotonic() - started < deadline:
        time.sleep(0.05)


@mpi_test(np=(3,), env=FAST_STALL, init=False)
def test_disagreements_that_end_in_the_stall_report():
    """Calls that never match across ranks end with the stall report, not a hang."""
    pair = mt.ProcessSet([0, 1])
    mt.init(process_sets=[pair])
    r = mt.rank()
    where = pair if r == 1 else mt.global_process_set      # one name, two sets
    # whichever set's coordinator gives up first names the rank it misses
    expect_everywhere("'on.two.sets'", lambda: mt.allreduce(
        np.ones(2), name="on.two.sets", process_set=where), "stall")
    mt.shutdown()

    mt.init()
    arrays = [np.ones(2)] * (2 if r == 0 else 3)           # different group sizes
    expect_everywhere("'grouped_0of2'", lambda: mt.grouped_allreduce(
        arrays, name="grouped"), "'grouped_0of3'", "stall")
    mt.shutdown()



@mpi_test()
def test_an_argument_only_one_rank_gets_wrong_fails_every_rank_at_once():
    """Rank 0 alone passes a bad op, root or scale: nobody waits for a stall."""
    r = mt.rank()
    for name, problem, bad, good, call in [
            ("bad.op", "unknown reduction op", "sum", mt.Sum,
             lambda op, name: mt.allreduce(np.ones(2), op=op, name=name)),
            ("bad.root", "root_rank must be a whole number", "zero", 0,
             lambda root, name: mt.broadcast(np.ones(2), root, name=name)),
            ("bad.scale", "must be numbers", "half", 0.5,
             lambda scale, name: mt.allreduce(np.ones(2), prescale_factor=scale,
                                              name=name))]:
        with pytest.raises(ValueError, match=problem) as caught:
            call(bad if r == 0 else good, name)
        assert f"'{name}'" in str(caught.value) and "rank 0" in str(caught.value)
    engine_still_works()


@mpi_test()
def test_a_bad_argument_on_one_rank_under_a_name_used_before_fails_at_once():
    """The other ranks find the name in their response cache: they must not wait there."""
    r = mt.rank()
    for _ in range(2):
        assert mt.broadcast(np.full(2, float(r)), 0, name="used.before")[0] == 0
        message = raises_everywhere(ValueError, "root_rank must be a whole number",
                                    lambda: mt.broadcast(np.ones(2), "zero" if r == 0 else 0,
                                                         name="used.before"))
        assert "'used.before' failed on rank 0" in message
    engine_still_works()


@mpi_test()
def test_an_object_one_rank_cannot_pickle_fails_every_rank():
    """The root alone pickles in broadcast_object, so it alone can fail to."""
    r, n = mt.rank(), mt.size()
    unpicklable = threading.Lock()
    for root in (0, n - 1):
        message = raises_everywhere(TypeError, "cannot be pickled", lambda: mt.broadcast_object(
            {"lock": unpicklable} if r == root else None, root_rank=root, name="lock"))
        assert f"'lock.size' failed on rank {root}" in message
        assert "cannot pickle '_thread.lock' object" in message
    message = raises_everywhere(TypeError, "cannot be pickled", lambda: mt.allgather_object(
        unpicklable if r == n - 1 else r, name="gather.lock"))
    assert f"failed on rank {n - 1}" in message
    for _ in range(2):          # the second failure comes after a cached success
        assert mt.broadcast_object("fine", root_rank=n - 1, name="lock") == "fine"
        assert mt.allgather_object(r, name="gather.lock") == list(range(n))
        raises_everywhere(TypeError, "cannot be pickled", lambda: mt.broadcast_object(
            unpicklable if r == 0 else None, root_rank=0, name="lock"))
        raises_everywhere(TypeError, "cannot be pickled", lambda: mt.allgather_object(
            unpicklable if r == 0 else r, name="gather.lock"))
    engine_still_works()


def test_every_test_docs_bad_input_names_exists():
    """Named as file::test, or file::test[framework-np2] for a case of
    bad_input_table.py that the file runs."""
    def source(filename):
        with open(os.path.join(os.path.dirname(__file__), filename)) as stream:
            return stream.read()
    cited = set(re.findall(r"`(\w+\.py)::(test_\w+)(?:\[[\w.-]+\])?`",
                           source("../docs/bad-input.md")))
    assert len(cited) > 30
    table = source("bad_input_table.py")
    missing = []
    for filename, name in sorted(cited):
        text = source(filename)
        if f"def {name}(" not in text and not (
                "bad_input_table.tests_for(" in text and f"def {name}(" in table):
            missing.append(f"{filename}::{name}")
    assert not missing


@mpi_test()
def test_input_only_one_rank_cannot_submit_fails_every_rank_at_once():
    """Not argument checks: an input that is no array, an output that is none."""
    r = mt.rank()
    started = time.monotonic()
    ragged = [[1.0, 2.0], [3.0]] if r == 1 else [[1.0, 2.0], [3.0, 4.0]]
    raises_everywhere(mt.MpitrainInternalError,
                      r"'ragged' failed on rank 1: the input cannot be made an array: "
                      "ValueError: ", lambda: mt.allreduce(ragged, name="ragged"))
    x = np.zeros(3)
    raises_everywhere(TypeError, r"'not.an.array' failed on rank 1: output= must be an "
                                 "array of the input's kind, got list",
                      lambda: mt.synchronize(mt.allreduce_async(
                          x, name="not.an.array", output=[0, 0, 0] if r == 1 else x)))
    raises_everywhere(mt.MpitrainInternalError, r"'group.ragged_0of2'.* failed on rank 1",
                      lambda: mt.grouped_allreduce([x, ragged], name="group.ragged"))
    assert time.monotonic() - started < 10, "the others waited for a stall report"
    engine_still_works()


@mpi_test()
def test_names_must_be_strings_and_a_number_fails_the_ranks_that_used_its_text():
    r = mt.rank()
    x = np.ones(2)
    started = time.monotonic()
    with pytest.raises(TypeError, match=r"name must be a string, got list \['a'\]"):
        mt.allreduce(x, name=["a"])
    raises_everywhere(TypeError, "'5' failed on rank 0: name must be a string, got int 5",
                      lambda: mt.allreduce(x, name=5 if r == 0 else "5"))
    raises_everywhere(TypeError, "'7_0of1' failed on rank 0: name must be a string",
                      lambda: mt.grouped_allreduce([x], name=7 if r == 0 else "7"))
    assert time.monotonic() - started < 10, "the others waited for a stall report"
    engine_still_works()


@mpi_test(init=False)
def test_init_again_with_other_arguments_is_refused_not_ignored():
    mt.init(process_sets=[[0]])
    try:
        mt.init()                                  # the same again, or nothing: fine
        mt.init(process_sets=[[0]])
        mt.init(comm=None, process_sets=[mt.ProcessSet([0])])
        for other in ({"process_sets": [[1]]}, {"comm": [0]}, {"process_sets": "dynamic"}):
            with pytest.raises(ValueError, match=r"already running, started with comm=None "
                                                 r"and process_sets=\[\[0\]\]; init\(\) "
                                                 "with other arguments would be ignored"):
                mt.init(**other)
        engine_still_works()
    finally:
        mt.shutdown()
    mt.init(process_sets=[[1]])                    # after shutdown(): anything goes
    engine_still_works()
    mt.shutdown()


@mpi_test()
def test_collectives_in_a_forked_child_raise_instead_of_waiting_forever():
    r = mt.rank()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:              # the child reports through the pipe and leaves at once
        try:
            answers = [str(mt.is_initialized()), str(mt.rank())]
            for call in (lambda: mt.allreduce(np.ones(2)), lambda: mt.barrier(), mt.init):
                try:
                    call()
                    answers.append("no error")
                except RuntimeError as error:
                    answers.append(str(error))
            os.write(write, "\n".join(answers).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as stream:
        answers = stream.read().split("\n")
    os.waitpid(child, 0)
    assert answers[:2] == ["False", str(r)]
    for answer in answers[2:]:
        assert answer.startswith(f"this process (pid {child}) is a fork() of rank {r} "
                                 f"(pid {os.getpid()}), which started mpitrain"), answer
    assert mt.is_initialized()
    engine_still_works()


@mpi_test()
def test_unnamed_calls_from_a_second_thread_are_refused():
    """Two threads' unnamed calls interleave differently on each rank."""
    x = np.ones(3)
    mt.allreduce(x)                           # this thread numbers the unnamed calls
    seen = []

    def loader():
        try:
            mt.allreduce(x)
        except ValueError as error:
            seen.append(str(error))
        seen.append(mt.allreduce(x, name="from.loader", op=mt.Sum)[0])   # named: fine

    thread = threading.Thread(target=loader, name="loader")
    thread.start()
    thread.join()
    assert seen[0].startswith("an unnamed allreduce from thread 'loader': process set 0 "
                              "numbers unnamed calls in the order they come, and its "
                              "first came from thread 'MainThread'")
    assert seen[1] == mt.size()
    engine_still_works()


@mpi_test()
def test_one_extra_unnamed_call_on_one_rank_fails_at_the_first_wrong_pairing():
    r = mt.rank()
    x = np.full(4, r + 1.0)
    for _ in range(3):
        mt.allreduce(x, op=mt.Sum)
    with pytest.raises(mt.MismatchError) as caught:
        if r == 1:
            mt.allreduce(x, op=mt.Sum)        # one call more, the same shape and dtype
        else:
            mt.allreduce(x, op=mt.Sum)
    message = str(caught.value)
    assert "mismatched places in the program (unnamed calls pair up in the order each " \
           "rank makes them" in message
    assert re.search(r"ranks? 0(, 2)?: test_bad_input\.py:\d+; rank 1: "
                     r"test_bad_input\.py:\d+", message), message
    engine_still_works()


@mpi_test()
def test_an_array_written_by_one_operation_in_flight_is_refused_to_another():
    """Rank 1 reuses an array that its first operation still writes (in place)
    or reads; the ranks that did nothing wrong fail that name too, and the
    operation in flight keeps its right answer."""
    r = mt.rank()
    for second in ("in_place", "read"):
        t = np.full(4, r + 1.0)
        expected = sum(range(1, mt.size() + 1))
        if r == 1:
            first = mt.allreduce_async(t, name=f"first.{second}", op=mt.Sum, output=t)
            with pytest.raises(CollectiveValueError) as caught:
                mt.allreduce_async(t, name=f"second.{second}", op=mt.Sum,
                                   output=t if second == "in_place" else None)
            mt.synchronize(first)
        else:
            with pytest.raises(CollectiveValueError) as caught:
                mt.allreduce(np.ones(4), name=f"second.{second}")
            mt.allreduce_async(t, name=f"first.{second}", op=mt.Sum, output=t).wait()
        message = str(caught.value)
        assert f"'second.{second}'" in message and "rank 1" in message, message
        assert "still uses on this rank" in message and f"'first.{second}'" in message
        assert (t == expected).all(), t
    engine_still_works()


@mpi_test()
def test_one_array_twice_in_one_grouped_in_place_call_fails_every_rank():
    t = np.ones(3)
    with pytest.raises(CollectiveValueError, match="still uses on this rank"):
        mt.synchronize(mt.grouped_allreduce_async([t, t], name="twice", outputs=[t, t]))
    assert (t == 1).all()                       # nothing ran
    twice_read = mt.grouped_allreduce([t, t], name="read.twice", op=mt.Sum)
    assert [list(x) for x in twice_read] == [[mt.size()] * 3] * 2   # reading twice: fine
    engine_still_works()


@mpi_test()
def test_int64_averages_are_exact_where_their_sum_overflows():
    """[2**62 + rank] on 2 ranks averaged to -4611686018427387903: the sum
    wrapped around in int64. Against Python's exact arithmetic."""
    r, n = mt.rank(), mt.size()

    def values(rank):
        return [2 ** 62 + rank, 2 ** 63 - 1 - rank, -2 ** 63 + rank, -2 ** 62 - 3 * rank,
                7 * rank - 5, -1 - rank]

    sums = [sum(column) for column in zip(*(values(k) for k in range(n)))]
    exact = [int(Fraction(total, n)) for total in sums]        # truncated toward zero
    mine = np.array(values(r), np.int64)
    assert mt.allreduce(mine, name="int64.alone").tolist() == exact
    flipped = mine[::-1].copy()
    fused = mt.grouped_allreduce([mine, flipped], name="int64.fused")
    assert [f.tolist() for f in fused] == [exact, exact[::-1]]
    assert mt.reducescatter(np.tile(mine, (n, 1)), name="int64.rows").tolist() == [exact]
    halved = mt.allreduce(np.array([2 ** 62 + r], np.int64), postscale_factor=0.5,
                          name="int64.halved")
    assert halved.tolist() == [int(Fraction(sum(2 ** 62 + k for k in range(n)), 2 * n))]


@mpi_test()
def test_a_name_that_is_no_string_on_one_rank_fails_every_rank_at_once():
    """A list as name= on rank 1 failed there at once, and the others waited
    for the stall shutdown: the names differ, so nothing paired them up. Its
    call now fails theirs, also where they hold that name in the cache. (A
    barrier after each: rank 1, which caught its error, would otherwise run
    ahead, and its next call under the others' name pairs with theirs.)"""
    r = mt.rank()
    x = np.ones(2)
    mt.allreduce(x, name="cached")                        # a cache hit from now on
    for name in ("fresh", "cached"):
        with pytest.raises(TypeError) as caught:
            mt.allreduce(x, name=[name] if r == 1 else name)
        assert str(caught.value) == (
            f"allreduce of '{[name]}' failed on rank 1: " if r == 1 else
            f"allreduce of '{name}' failed on rank 1: ") + \
            f"name must be a string, got list {[name]!r}"
        mt.barrier()
    with pytest.raises(TypeError, match=r"_0of2'.* failed on rank 1: name must be a "
                                        r"string, got tuple \('group',\)"):
        mt.grouped_allreduce([x, x], name=("group",) if r == 1 else "group")
    mt.barrier()
    assert mt.allreduce(x, op=mt.Sum, name="cached")[0] == mt.size()   # in step again
    engine_still_works()


@mpi_test(init=False)
def test_once_unnamed_calls_stop_pairing_every_later_one_fails_naming_the_first():
    """One unnamed call more on rank 1, caught: the next unnamed calls paired
    rank 0's step 1 with rank 1's step 0 and summed values of two steps. An
    engine of its own: the numbers stay stopped for good."""
    mt.init()
    try:
        r, n = mt.rank(), mt.size()
        got = []
        for step in range(3):
            if r == 1 and step == 0:
                with pytest.raises(mt.MismatchError, match="mismatched places"):
                    mt.allreduce(np.zeros(1), op=mt.Sum)          # one call more
            try:
                got.append(mt.allreduce(np.array([10.0 * step + r]), op=mt.Sum)[0])
            except mt.MismatchError as error:
                got.append(str(error))
        assert all(isinstance(each, str) for each in got), got
        first = "allreduce of 'allreduce.noname.0' failed: mismatched places in the program"
        later = got if r == 1 else got[1:]
        if r != 1:
            assert got[0].startswith(first), got[0]
        for message in later:
            assert message.startswith(
                "an unnamed allreduce on process set 0: unnamed allreduces no longer "
                f"pair up since the first that did not: {first}"), message
            assert message.endswith("Every later unnamed allreduce fails; pass name=... "
                                    "to each call")
        assert mt.allgather(np.array([r])).tolist() == list(range(n))  # other kinds: fine
        engine_still_works()
    finally:
        mt.shutdown()


@mpi_test(init=False)
def test_unnamed_calls_pass_to_another_thread_once_the_first_has_ended():
    """A worker thread that made unnamed calls and ended left the main thread
    refused for the rest of the job ("its first came from thread 'warm-up'")."""
    mt.init()
    try:
        n = mt.size()
        seen = []
        worker = threading.Thread(name="warm-up", target=lambda: seen.append(
            mt.allreduce(np.ones(2), op=mt.Sum)[0]))
        worker.start()
        worker.join()
        assert seen == [n]
        assert mt.allreduce(np.ones(2), op=mt.Sum).tolist() == [n, n]
    finally:
        mt.shutdown()
