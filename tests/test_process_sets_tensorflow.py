"""TensorFlow's gradient reduction on a process set: members average, and
the other ranks keep their own gradients, as in Horovod (whose allreduce of
gradients is the identity outside the set)."""

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")

import keras

import mpitrain.tensorflow as hvd
import mpitrain.tensorflow.keras as hvd_keras


@mpi_test(np=(3,), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120)
def test_a_rank_outside_the_set_keeps_its_gradients_in_the_tape_and_in_fit():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    r = hvd.rank()
    upper = hvd.add_process_set([1, 2])
    try:
        w = tf.Variable([1.0, 1.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * float(r + 1))
        tape = hvd.DistributedGradientTape(tape, process_set=upper)
        (gradient,) = tape.gradient(loss, [w])
        assert gradient.numpy().tolist() == ([1.0, 1.0] if r == 0 else [2.5, 2.5])

        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
        model.compile(optimizer=hvd_keras.DistributedOptimizer(
            keras.optimizers.SGD(1.0), process_set=upper), loss="mse", jit_compile=False)
        before = model.get_weights()[0][0, 0]
        x = np.full((1, 1), float(r + 1), np.float32)
        model.fit(x, np.zeros((1, 1), np.float32), batch_size=1, epochs=1, verbose=0)
        # d/dw (w x)^2 = 2 w x^2: rank 0 alone, the members averaged
        squares = 1.0 if r == 0 else (4.0 + 9.0) / 2
        np.testing.assert_allclose(model.get_weights()[0][0, 0],
                                   before - 2 * before * squares, rtol=1e-5)
    finally:
        hvd.remove_process_set(upper)
