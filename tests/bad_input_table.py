"""The bad input every framework gets alike, each case written once (docs/bad-input.md).

Each case runs on numpy, torch, TensorFlow eagerly and, where it applies,
inside tf.function, through the adapters of tests/frameworks.py, and checks
the answer on every rank and that the engine still works afterwards. Each
framework's test file runs the table among its own tests (the bad input only
it can get), as ``test_case[framework-np2]``::

    globals().update(bad_input_table.tests_for("torch"))

so that each job imports one framework: TensorFlow takes some 8 s per job
to import (12 s on 3 ranks), torch 4 s (6 s).
"""

import functools

import numpy as np
import pytest

import mpitrain as mt
from tests.frameworks import framework
from tests.mpi_harness import mpi_test
from tests.test_errors import raises_everywhere

EAGERLY = ("numpy", "torch", "tensorflow")
EVERYWHERE = EAGERLY + ("tf.function",)

_CASES = []


def case(*frameworks, np=(2, 3), init=True):
    """A case of the table: body(adapter), run on ``frameworks`` with the
    options of mpi_test; the test takes the framework's name."""
    def add(body):
        @functools.wraps(body)
        def on(name):
            body(framework(name))
        _CASES.append((on, frameworks, {"np": np, "init": init}))
        return body
    return add


def tests_for(*frameworks, **job_options):
    """The cases that apply to any of ``frameworks``, as tests of mpi_test
    (with ``job_options``) run for each of them: name -> test."""
    tests = {}
    for body, applies_to, options in _CASES:
        over = tuple(name for name in frameworks if name in applies_to)
        if over:
            tests[body.__name__] = mpi_test(over=over, **options, **job_options)(body)
    return tests


@case(*EVERYWHERE)
def test_mismatched_shapes_and_dtypes_fail_every_collective_on_every_rank(fw):
    r, n = fw.api.rank(), fw.api.size()
    for label, call in fw.every_collective(fw.zeros((n, 2 + r)), "shape").items():
        message = raises_everywhere(fw.mismatch_error, "mismatched shapes",
                                    lambda: fw.run(call))
        assert "rank 0: (" in message, (label, message)
    for other in ("float64", "int64"):
        typed = fw.zeros((n, 2), "float32" if r == 0 else other)
        for label, call in fw.every_collective(typed, f"dtype.{other}").items():
            message = raises_everywhere(fw.mismatch_error, "mismatched data types",
                                        lambda: fw.run(call))
            assert "rank 0: float32" in message and other in message, (label, message)
    fw.engine_still_works()


@case(*EAGERLY)
def test_mismatched_ops_scale_factors_and_roots_fail_on_every_rank(fw):
    hvd = fw.api
    r, n = hvd.rank(), hvd.size()
    rows = fw.ones((n, 2))
    for pattern, call in [
            ("reduction ops.*rank 0: Sum", lambda: hvd.allreduce(
                rows, op=hvd.Sum if r == 0 else hvd.Max, name="op")),
            ("reduction ops.*rank 0: Sum", lambda: hvd.reducescatter(
                rows, op=hvd.Sum if r == 0 else hvd.Average, name="rs.op")),
            ("prescale factors", lambda: hvd.allreduce(
                rows, prescale_factor=1.0 + r, name="prescale")),
            ("prescale factors", lambda: hvd.reducescatter(
                rows, prescale_factor=1.0 + r, name="rs.prescale")),
            ("postscale factors", lambda: hvd.allreduce(
                rows, postscale_factor=1.0 + r, name="postscale")),
            ("postscale factors", lambda: hvd.reducescatter(
                rows, postscale_factor=1.0 + r, name="rs.postscale")),
            ("root ranks", lambda: hvd.broadcast(rows, r % 2, name="root"))]:
        raises_everywhere(fw.mismatch_error, pattern, call)
    fw.engine_still_works()


@case(*EVERYWHERE)
def test_unsupported_dtypes_fail_every_collective_on_every_rank(fw):
    n = fw.api.size()
    for dtype in fw.unsupported_dtypes:
        for label, call in fw.every_collective(fw.zeros((n, 2), dtype),
                                               f"unsupported.{dtype}").items():
            if fw.refuses(label, dtype):
                message = raises_everywhere(fw.type_error, "unsupported dtype",
                                            lambda: fw.run(call))
                assert "mpitrain supports" in message, (label, message)
    fw.engine_still_works()


@case(*EAGERLY)
def test_zero_size_inputs_give_empty_results_on_every_collective(fw):
    n = fw.api.size()
    empty = fw.zeros((0, 3))
    for label, call in fw.every_collective(empty, "empty").items():
        result = call()
        if isinstance(result, tuple):          # numpy's alltoall: rows, received splits
            result, received = result
            assert fw.to_numpy(received).tolist() == [0] * n, label
        shapes = [tuple(t.shape) for t in (result if isinstance(result, list) else [result])]
        assert all(shape == (0, 3) for shape in shapes), (label, shapes)
    mixed = fw.api.grouped_allreduce([empty, fw.ones((2,))], name="empty.and.not")
    assert [tuple(t.shape) for t in mixed] == [(0, 3), (2,)]
    fw.engine_still_works()


@case("numpy", "torch")
def test_noncontiguous_inputs_give_the_right_answer_on_every_collective(fw):
    hvd = fw.api
    r, n = hvd.rank(), hvd.size()
    layouts = {"sliced": lambda k: (np.arange(8.0 * n).reshape(2 * n, 4) + 100 * k)[::2, ::2],
               "transposed": lambda k: (np.arange(4.0 * n).reshape(4, n) + 10 * k).T}
    for layout, of_rank in layouts.items():
        everyone = [of_rank(k) for k in range(n)]            # (n, 2) and (n, 4)
        strided = fw.from_numpy(of_rank(r))
        assert not fw.is_contiguous(strided)
        rows = hvd.alltoall(strided, name=f"{layout}.a2a")
        for got, expected in [
                (hvd.allreduce(strided, op=hvd.Sum, name=f"{layout}.ar"), sum(everyone)),
                (hvd.allgather(strided, name=f"{layout}.ag"), np.concatenate(everyone)),
                (rows[0] if isinstance(rows, tuple) else rows,          # numpy: rows, splits
                 np.stack([e[r] for e in everyone])),
                (hvd.reducescatter(strided, op=hvd.Sum, name=f"{layout}.rs"),
                 sum(everyone)[r:r + 1])]:
            np.testing.assert_array_equal(fw.to_numpy(got), expected, err_msg=layout)
        for label, call in fw.every_broadcast(fw.from_numpy(of_rank(r)), layout, n - 1).items():
            np.testing.assert_array_equal(fw.to_numpy(call()), everyone[n - 1],
                                          err_msg=f"{layout} {label}")
    fw.engine_still_works()


@case(*EVERYWHERE)
def test_scalars_reduce_and_broadcast_but_do_not_gather_or_scatter(fw):
    hvd = fw.api
    r, n = hvd.rank(), hvd.size()
    total = fw.run(lambda: hvd.allreduce(fw.scalar(r + 1, "float32"), op=hvd.Sum))
    assert fw.to_numpy(total) == n * (n + 1) / 2
    assert fw.to_numpy(fw.run(lambda: hvd.broadcast(fw.scalar(r + 7, "int64"), n - 1))) == n + 6
    for call in (lambda: hvd.allgather(fw.scalar(1, "float32")),
                 lambda: hvd.alltoall(fw.scalar(1, "float32")),
                 lambda: hvd.reducescatter(fw.scalar(1, "float32"))):
        raises_everywhere(fw.value_error, "at least one dimension, got a scalar",
                          lambda: fw.run(call))
    fw.engine_still_works()


@case(*EAGERLY)
def test_a_root_out_of_range_fails_on_every_rank(fw):
    hvd = fw.api
    r, n = hvd.rank(), hvd.size()
    for root in (n, -1, 10 ** 6):
        for call in fw.every_broadcast(fw.ones((2,)), f"root.{root}", root).values():
            raises_everywhere(fw.value_error, f"root_rank {root} is out of range", call)
    raises_everywhere(ValueError, f"root_rank {n} is out of range",
                      lambda: hvd.broadcast_object({"epoch": 1}, root_rank=n))
    # only the last rank gets it wrong: the others hear which rank it was
    message = raises_everywhere(fw.value_error, "out of range", lambda: hvd.broadcast(
        fw.ones((2,)), n if r == n - 1 else 0, name="one.bad.root"))
    assert f"failed on rank {n - 1}" in message
    fw.engine_still_works()


@case(*EAGERLY)
def test_alltoall_splits_that_do_not_fit_fail_on_every_rank(fw):
    hvd = fw.api
    n = hvd.size()
    rows = fw.ones((n, 2))
    for pattern, splits in [("add up to", [n] * n),
                            ("non-negative whole numbers, one per rank",
                             [-1] + [1] * (n - 2) + [2]),
                            ("one per rank", [n])]:
        raises_everywhere(fw.value_error, pattern,
                          lambda: hvd.alltoall(rows, splits=fw.splits(splits)))
    raises_everywhere(fw.value_error, "divisible", lambda: hvd.alltoall(fw.ones((n + 1, 2))))
    fw.engine_still_works()


@case(*EAGERLY)
def test_a_process_set_this_rank_is_not_in(fw):
    """Rank 0 alone, then every rank but the last: the members are not held up."""
    hvd = fw.api
    r, n = hvd.rank(), hvd.size()
    for members in sorted({(0,), tuple(range(n - 1))}):
        process_set = hvd.add_process_set(list(members))
        for call in fw.every_collective(fw.ones((2, 2)), f"members.{len(members)}",
                                        process_set).values():
            if r in members:
                call()
            else:
                with pytest.raises(ValueError, match=rf"this rank \({r}\) is not a member"):
                    call()
        hvd.remove_process_set(process_set)
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(fw.ones((1,)), process_set=mt.ProcessSet([0, n - 1]))
    fw.engine_still_works()


@case(*EAGERLY, init=False)
def test_calls_before_init_and_after_shutdown_say_to_call_init(fw):
    for says in (r"not been initialized; call mpitrain.init\(\)",     # before init()
                 r"call mpitrain.init\(\)"):                           # after shutdown()
        for call in fw.calls_that_need_init().values():
            with pytest.raises(ValueError, match=says):
                call()
        fw.api.init()
        fw.engine_still_works()
        fw.api.shutdown()
