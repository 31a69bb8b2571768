"""mpitrain.tensorflow.keras with tf_keras (Keras 2, TF_USE_LEGACY_KERAS=1)."""

import importlib.util

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tf_keras") is None,
    reason="tf_keras is not installed (pip install --no-deps tf_keras==2.21.0)")

LEGACY_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}


@mpi_test(np=(2,), env=LEGACY_ENV, timeout=180)
def test_fit_with_tf_keras_optimizers_equals_one_process_on_the_whole_batch():
    import tensorflow as tf
    import mpitrain.tensorflow.keras as hvd
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    assert tf.keras.__name__.startswith("tf_keras")
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * n, 5)).astype(np.float32)
    y = rng.normal(size=(8 * n, 2)).astype(np.float32)
    whole = np.concatenate([np.arange(k, 8 * n, n) for k in range(n)])

    def model(seed):
        tf.keras.utils.set_random_seed(seed)
        return tf.keras.Sequential([tf.keras.Input((5,)),
                                    tf.keras.layers.Dense(4, activation="tanh"),
                                    tf.keras.layers.Dense(2)])

    reference = model(0)
    reference.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x[whole], y[whole], batch_size=8 * n, epochs=2, shuffle=False, verbose=0)
    for make in (lambda: tf.keras.optimizers.SGD(0.1),
                 lambda: tf.keras.optimizers.legacy.SGD(0.1),
                 lambda: tf.keras.mixed_precision.LossScaleOptimizer(
                     tf.keras.optimizers.SGD(0.1))):
        plain = make()
        optimizer = hvd.DistributedOptimizer(plain)
        assert type(optimizer).__name__ == type(plain).__name__
        trained = model(r)
        trained.compile(optimizer=optimizer, loss="mse")
        history = trained.fit(x[r::n], y[r::n], batch_size=8, epochs=2, shuffle=False,
                              verbose=0,
                              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                         hvd.callbacks.MetricAverageCallback()])
        for got, want in zip(trained.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        losses = hvd.allgather_object(history.history["loss"])
        assert all(other == losses[0] for other in losses)
