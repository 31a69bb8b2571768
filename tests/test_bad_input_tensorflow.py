"""Bad input only mpitrain.tensorflow and .keras get (docs/bad-input.md).

tests/test_tensorflow_collectives.py maps allreduce's errors to tf.errors and
checks the tape's layout mismatch; tests/bad_input_table.py's cases, which
every framework shares, run here eagerly and inside tf.function. This file
covers what only TensorFlow does: raw-byte broadcasts, strings, variables,
Keras models that differ between ranks, ragged tensors.
"""

import numpy as np
import pytest

from tests import bad_input_table
from tests.frameworks import TensorFlow
from tests.mpi_harness import mpi_test
from tests.test_errors import raises_everywhere

tf = pytest.importorskip("tensorflow")
import keras

import mpitrain.tensorflow as hvd
import mpitrain.tensorflow.keras as hvd_keras

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}

# The shared cases, first in each job (the one before init() wants a fresh process).
globals().update(bad_input_table.tests_for("tensorflow", "tf.function", env=TF_ENV, timeout=120))


@mpi_test(env=TF_ENV, timeout=120)
def test_broadcast_moves_unsupported_dtypes_as_raw_bytes_and_gathers_bool():
    """As in Horovod; the other collectives refuse them (bad_input_table.py)."""
    tensorflow = TensorFlow()
    n = hvd.size()
    for dtype in ("complex64", "bool", "uint32"):
        for label, call in tensorflow.every_collective(tensorflow.zeros((n, 2), dtype),
                                                       f"bytes.{dtype}").items():
            if not tensorflow.refuses(label, dtype):
                result = call()
                assert (result[0] if isinstance(result, list) else result).dtype == dtype
    tensorflow.engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_a_string_broadcast_is_refused_clearly():
    raises_everywhere((TypeError, tf.errors.InvalidArgumentError), "string",
                      lambda: hvd.broadcast(tf.constant(["text"]), 0))


@mpi_test(env=TF_ENV, timeout=120)
def test_a_root_out_of_range_fails_broadcast_variables_on_every_rank():
    tensorflow = TensorFlow()
    r, n = hvd.rank(), hvd.size()
    variables = [tf.Variable([1.0]), tf.Variable([2.0, 3.0])]
    raises_everywhere(tf.errors.InvalidArgumentError, "out of range",
                      lambda: hvd.broadcast_variables(variables, root_rank=n))
    # only the last rank gets it wrong: every variable fails on every rank
    message = raises_everywhere(tf.errors.InvalidArgumentError, "out of range", lambda:
                                hvd.broadcast_variables(variables, n if r == n - 1 else 0))
    assert f"failed on rank {n - 1}" in message
    hvd.broadcast_variables(variables, root_rank=0)      # the names still agree
    tensorflow.engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_keras_models_that_differ_between_ranks_fail_on_every_rank():
    tensorflow = TensorFlow()
    r = hvd.rank()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2 + r)])
    raises_everywhere(tf.errors.FailedPreconditionError, "mismatched shapes",
                      lambda: hvd.broadcast_variables(model.variables, root_rank=0))
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss="mse", jit_compile=False)
    x, y = np.ones((4, 3), np.float32), np.ones((4, 2 + r), np.float32)
    raises_everywhere(tf.errors.OpError, "mismatched gradient shapes across ranks: rank 0",
                      lambda: model.fit(x, y, batch_size=4, epochs=1, verbose=0))
    tensorflow.engine_still_works()


@mpi_test(env=TF_ENV, timeout=120)
def test_a_ragged_tensor_on_one_rank_fails_every_rank_at_once():
    import time
    tensorflow = TensorFlow()
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
    tensorflow.engine_still_works()
