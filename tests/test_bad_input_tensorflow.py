"""Bad input through mpitrain.tensorflow and .keras (docs/bad-input.md).

tests/test_tensorflow_collectives.py maps allreduce's errors to tf.errors and
checks the tape's layout mismatch; this file tries the other collectives,
eagerly and inside tf.function, and Keras models that differ between ranks.
"""

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")
import keras

import mpitrain.tensorflow as hvd
import mpitrain.tensorflow.keras as hvd_keras

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def one_thread():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def every_collective(tensor, name, process_set=hvd.global_process_set):
    """One call of each TensorFlow collective on ``tensor``: label -> thunk."""
    kw = {"process_set": process_set}
    return {
        "allreduce": lambda: hvd.allreduce(tensor, name=f"{name}.ar", **kw),
        "allgather": lambda: hvd.allgather(tensor, name=f"{name}.ag", **kw),
        "broadcast": lambda: hvd.broadcast(tensor, 0, name=f"{name}.bc", **kw),
        "alltoall": lambda: hvd.alltoall(tensor, name=f"{name}.a2a", **kw),
        "reducescatter": lambda: hvd.reducescatter(tensor, name=f"{name}.rs", **kw),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([tensor], name=f"{name}.gar",
                                                           **kw),
        "grouped_allgather": lambda: hvd.grouped_allgather([tensor], name=f"{name}.gag",
                                                           **kw),
    }


def raises_everywhere(error, pattern, call):
    with pytest.raises(error, match=pattern) as caught:
        call()
    return str(caught.value)


def engine_still_works():
    got = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="still.works")
    assert got.numpy().tolist() == [hvd.size()] * 2


@mpi_test(np=(2, 3), env=TF_ENV, timeout=120)
def test_mismatches_fail_every_collective_on_every_rank_eagerly_and_in_graphs():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    for label, call in every_collective(tf.zeros([n, 2 + r]), "shape").items():
        message = raises_everywhere(tf.errors.FailedPreconditionError,
                                    "mismatched shapes", call)
        assert "rank 0: (" in message, (label, message)
    typed = tf.zeros([n, 2], tf.float32 if r == 0 else tf.float64)
    for call in every_collective(typed, "dtype").values():
        raises_everywhere(hvd.MismatchError, "mismatched data types", call)
    for call in every_collective(tf.zeros([n, 2 + r]), "graph").values():
        raises_everywhere(tf.errors.OpError, "mismatched shapes", tf.function(call))
    rows = tf.ones([n, 2])
    raises_everywhere(hvd.MismatchError, "reduction ops", lambda: hvd.reducescatter(
        rows, op=hvd.Sum if r == 0 else hvd.Average, name="rs.op"))
    raises_everywhere(hvd.MismatchError, "prescale factors", lambda: hvd.allreduce(
        rows, prescale_factor=1.0 + r, name="prescale"))
    raises_everywhere(hvd.MismatchError, "root ranks", lambda: hvd.broadcast(
        rows, r % 2, name="root"))
    engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_unsupported_dtypes_fail_on_every_rank_and_broadcast_moves_raw_bytes():
    one_thread()
    n = hvd.size()
    for dtype in (tf.complex64, tf.bool, tf.uint32):
        for label, call in every_collective(tf.zeros([n, 2], dtype), "unsupported").items():
            if label == "broadcast" or (dtype == tf.bool and label in (
                    "allgather", "grouped_allgather", "alltoall")):
                result = call()                       # travels as bytes, as in Horovod
                assert (result[0] if isinstance(result, list) else result).dtype == dtype
            else:
                raises_everywhere(tf.errors.InvalidArgumentError, "unsupported dtype", call)
    raises_everywhere(tf.errors.InvalidArgumentError, "unsupported dtype",
                      lambda: hvd.allgather(tf.constant(["text"] * n)))
    raises_everywhere(tf.errors.InvalidArgumentError, "unsupported dtype",
                      tf.function(lambda: hvd.allreduce(tf.zeros([2], tf.complex64))))
    engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_a_string_broadcast_is_refused_clearly():
    raises_everywhere((TypeError, tf.errors.InvalidArgumentError), "string",
                      lambda: hvd.broadcast(tf.constant(["text"]), 0))


@mpi_test(env=TF_ENV, timeout=120)
def test_empty_and_scalar_tensors_eagerly_and_in_graphs():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    for label, call in every_collective(tf.zeros([0, 3]), "empty").items():
        result = call()
        parts = result if isinstance(result, (list, tuple)) else [result]
        assert parts[0].shape == (0, 3), label
    assert hvd.allreduce(tf.constant(float(r + 1)), op=hvd.Sum).numpy() == n * (n + 1) / 2
    assert hvd.broadcast(tf.constant(r + 7), n - 1).numpy() == n + 6
    for call in (lambda: hvd.allgather(tf.constant(1.0)),
                 lambda: hvd.alltoall(tf.constant(1.0)),
                 lambda: hvd.reducescatter(tf.constant(1.0))):
        raises_everywhere(tf.errors.InvalidArgumentError, "got a scalar", call)
        raises_everywhere(tf.errors.InvalidArgumentError, "got a scalar", tf.function(call))
    engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_roots_splits_and_process_sets_that_do_not_fit():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    for root in (n, -1):
        raises_everywhere(tf.errors.InvalidArgumentError, "out of range",
                          lambda root=root: hvd.broadcast(tf.ones([2]), root))
    raises_everywhere(tf.errors.InvalidArgumentError, "out of range",
                      lambda: hvd.broadcast_variables([tf.Variable([1.0])], root_rank=n))
    rows = tf.ones([n, 2])
    raises_everywhere(tf.errors.InvalidArgumentError, "add up to",
                      lambda: hvd.alltoall(rows, splits=[n] * n))
    raises_everywhere(tf.errors.InvalidArgumentError, "non-negative",
                      lambda: hvd.alltoall(rows, splits=[-1] + [1] * (n - 2) + [2]))
    alone = hvd.add_process_set([0])
    for call in every_collective(tf.ones([1, 2]), "alone", alone).values():
        if r == 0:
            call()
        else:
            with pytest.raises(ValueError, match="not a member"):
                call()
    hvd.remove_process_set(alone)
    engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_a_root_only_one_rank_gets_wrong_fails_every_variable_on_every_rank():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    variables = [tf.Variable([1.0]), tf.Variable([2.0, 3.0])]
    message = raises_everywhere(tf.errors.InvalidArgumentError, "out of range", lambda:
                                hvd.broadcast_variables(variables, n if r == n - 1 else 0))
    assert f"failed on rank {n - 1}" in message
    hvd.broadcast_variables(variables, root_rank=0)      # the names still agree
    engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_keras_models_that_differ_between_ranks_fail_on_every_rank():
    one_thread()
    r = hvd.rank()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2 + r)])
    raises_everywhere(tf.errors.FailedPreconditionError, "mismatched shapes",
                      lambda: hvd.broadcast_variables(model.variables, root_rank=0))
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse", jit_compile=False)
    x, y = np.ones((4, 3), np.float32), np.ones((4, 2 + r), np.float32)
    raises_everywhere(tf.errors.OpError, "mismatched gradient shapes across ranks: rank 0",
                      lambda: model.fit(x, y, batch_size=4, epochs=1, verbose=0))
    engine_still_works()


@mpi_test(env=TF_ENV, timeout=120, init=False)
def test_calls_before_init_and_after_shutdown_say_to_call_init():
    one_thread()
    for call in every_collective(tf.ones([2, 1]), "uninitialized").values():
        with pytest.raises(ValueError, match=r"call mpitrain.init\(\)"):
            call()
    hvd.init()
    engine_still_works()
    hvd.shutdown()
    for call in every_collective(tf.ones([2, 1]), "shut.down").values():
        with pytest.raises(ValueError, match=r"call mpitrain.init\(\)"):
            call()
    hvd.init()
    engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_a_ragged_tensor_on_one_rank_fails_every_rank_at_once():
    import time
    r = hvd.rank()
    dense = tf.ones([2, 2])
    odd = tf.ragged.constant([[1.0], [2.0, 3.0]]) if r == 1 else dense
    started = time.monotonic()
    calls = {"allreduce": lambda: hvd.allreduce(odd, name="ragged.ar"),
             "allgather": lambda: hvd.allgather(odd, name="ragged.ag"),
             "broadcast": lambda: hvd.broadcast(odd, 0, name="ragged.bc"),
             "grouped_allreduce": lambda: hvd.grouped_allreduce([dense, odd],
                                                                name="ragged.gar"),
             "unnamed": lambda: hvd.allreduce(odd)}
    for label, call in calls.items():
        message = raises_everywhere(tf.errors.OpError, "failed on rank 1: .* input cannot "
                                                       "be a dense tensor", call)
        assert "RaggedTensor" in message, (label, message)
    assert time.monotonic() - started < 20, "the others waited for a stall report"
    engine_still_works()
