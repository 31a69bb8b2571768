"""Bad input fails on every rank with a clear message, and the engine goes on."""

import numpy as np
import pytest

import mpitrain as mt
from tests.mpi_harness import mpi_test


def engine_still_works():
    assert mt.allreduce(np.ones(2), op=mt.Sum, name="still.works")[0] == mt.size()


def raises_everywhere(error, pattern, call):
    with pytest.raises(error, match=pattern) as caught:
        call()
    return str(caught.value)


@mpi_test()
def test_mismatched_shapes_dtypes_ops_and_scales_fail_on_every_rank():
    r = mt.rank()
    cases = [
        ("shape", dict(array=np.zeros(3 + (r > 0), np.float32)), "shapes",
         "rank 0: (3,)"),
        ("dtype", dict(array=np.zeros(3, np.float32 if r == 0 else np.int32)),
         "data types", "rank 0: float32"),
        ("op", dict(array=np.zeros(3), op=mt.Sum if r == 0 else mt.Max),
         "reduction ops", "rank 0: Sum"),
        ("prescale", dict(array=np.zeros(3), prescale_factor=1.0 + r), "prescale",
         "rank 0: 1.0"),
        ("postscale", dict(array=np.zeros(3), postscale_factor=1.0 + r), "postscale",
         "rank 0: 1.0"),
    ]
    for name, kwargs, what, rank0 in cases:
        message = raises_everywhere(mt.MismatchError, f"mismatched {what}",
                                    lambda: mt.allreduce(name=f"bad.{name}", **kwargs))
        assert f"'bad.{name}'" in message and rank0 in message
        assert "rank 1:" in message or "ranks 1, 2:" in message
        assert isinstance(mt.MismatchError(""), RuntimeError)
    engine_still_works()


@mpi_test()
def test_mismatched_root_and_trailing_dimensions_and_operation():
    r = mt.rank()
    raises_everywhere(mt.MismatchError, "root ranks",
                      lambda: mt.broadcast(np.zeros(2), root_rank=r % 2, name="bad.root"))
    raises_everywhere(mt.MismatchError, "beyond the first dimension",
                      lambda: mt.allgather(np.zeros((1, 2 + r)), name="bad.gather"))
    call = ((lambda: mt.allreduce(np.zeros(2), name="bad.kind")) if r == 0 else
            (lambda: mt.allgather(np.zeros(2), name="bad.kind")))
    message = raises_everywhere(mt.MismatchError, "operations", call)
    assert "allreduce" in message and "allgather" in message
    engine_still_works()


@mpi_test()
def test_a_changed_shape_under_a_cached_name_is_an_error_then_works_again():
    n = mt.size()
    for _ in range(3):
        mt.allreduce(np.ones(4), op=mt.Sum, name="recached")
    raises_everywhere(mt.MismatchError, "shapes",
                      lambda: mt.allreduce(np.ones(4 + mt.rank()), name="recached"))
    assert (mt.allreduce(np.ones(5), op=mt.Sum, name="recached") == n).all()


@mpi_test()
def test_duplicate_in_flight_name_is_a_value_error_at_enqueue():
    import time
    if mt.rank() != 0:
        time.sleep(0.2)             # keep rank 0's first 'twice' in flight meanwhile
    handle = mt.allreduce_async(np.ones(2), name="twice")
    if mt.rank() == 0:
        with pytest.raises(ValueError, match="'twice' is already in flight"):
            mt.allreduce_async(np.ones(2), name="twice")
    mt.synchronize(handle)
    mt.synchronize(mt.allreduce_async(np.ones(2), name="twice"))


@mpi_test()
def test_unsupported_dtype_on_one_rank_fails_every_rank():
    r = mt.rank()
    x = np.zeros(3, np.complex64 if r == 1 else np.float32)
    message = raises_everywhere(TypeError, "unsupported dtype complex64",
                                lambda: mt.allreduce(x, name="complex"))
    assert "rank 1" in message and "'complex'" in message
    # the same name works once the input is fixed, on every rank
    assert (mt.allreduce(np.ones(3), op=mt.Sum, name="complex") == mt.size()).all()


@mpi_test()
def test_argument_errors_raise_on_every_rank():
    n = mt.size()
    raises_everywhere(ValueError, f"root_rank {n} is out of range",
                      lambda: mt.broadcast(np.zeros(2), root_rank=n))
    raises_everywhere(ValueError, "add up to",
                      lambda: mt.alltoall(np.zeros((4, 1)), splits=[1] * n))
    raises_everywhere(ValueError, "divisible",
                      lambda: mt.alltoall(np.zeros((n + 1, 1))))
    raises_everywhere(ValueError, "at least one dimension",
                      lambda: mt.allgather(np.float32(1)))
    raises_everywhere(ValueError, "only op=Average and op=Sum",
                      lambda: mt.reducescatter(np.zeros((n, 1)), op=mt.Max))
    raises_everywhere(TypeError, "op=Adasum combines floating-point",
                      lambda: mt.allreduce(np.zeros(2, np.int32), op=mt.Adasum))
    with pytest.raises(ValueError, match="unknown reduction op"):
        mt.allreduce(np.zeros(2), op=42)
    # only rank 0 passes a bad split: the others learn why instead of waiting
    splits = [3] * n if mt.rank() == 0 else None
    message = raises_everywhere(ValueError, "rank 0",
                                lambda: mt.alltoall(np.zeros((n, 1)), splits=splits,
                                                    name="one.bad"))
    assert "add up to" in message
    engine_still_works()


@mpi_test()
def test_error_classes_are_runtime_errors_like_horovod():
    assert mt.HorovodInternalError is mt.MpitrainInternalError
    for error in (mt.MismatchError, mt.ShutdownError):
        assert issubclass(error, mt.HorovodInternalError)
        assert issubclass(error, RuntimeError)


@mpi_test(init=False)
def test_calls_after_shutdown_fail_clearly_and_a_peer_shutdown_ends_waits():
    mt.init()
    if mt.rank() == 0:
        # rank 0 waits for a tensor rank 1 never sends; rank 1 shuts down instead
        with pytest.raises(mt.ShutdownError, match="rank 1: shutdown"):
            mt.allreduce(np.ones(2), name="never.sent")
        with pytest.raises(mt.ShutdownError, match="shut down"):
            mt.allreduce(np.ones(2), name="after")
        assert not mt.is_initialized()
    else:
        import time
        time.sleep(0.2)
        mt.shutdown()
        with pytest.raises(ValueError, match=r"init\(\)"):
            mt.allreduce(np.ones(2))
    mt.shutdown()


def test_a_rank_that_exits_early_ends_the_others_waits():
    from tests.mpi_harness import run_mpi
    job = run_mpi(2, ["tests/scripts/rank_exits_early.py"], timeout=30)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "rank 0 got ShutdownError" in job.stdout
    assert "rank 1: its process exited" in job.stdout
