"""Keras checkpoints: resuming gives what training straight through gives."""

import os
import re
import shutil
import tempfile

import numpy as np
import pytest

from tests.damage import flip_byte_in_the_middle
from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")

import keras  # noqa: E402

import mpitrain.tensorflow.keras as hvd  # noqa: E402
from tests.keras_models import compiled_model, make_model  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@mpi_test(env=TF_ENV, timeout=180)
def test_training_resumed_from_a_checkpoint_matches_training_straight_through():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    path = os.path.join(directory, "ckpt.npz")
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(16, 5)).astype(np.float32)
    y = rng.normal(size=(16, 2)).astype(np.float32)

    def train(model):
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)

    model = compiled_model(hvd.rank())
    assert hvd.load_checkpoint(path, model) is None         # every rank gets rank 0's
    train(model)
    hvd.save_checkpoint(path, model, epoch=2)
    train(model)
    expected = model.get_weights()

    resumed = compiled_model(100 + hvd.rank())                  # other weights, no state
    assert hvd.load_checkpoint(path, resumed) == {"epoch": 2}
    train(resumed)
    for got, want in zip(resumed.get_weights(), expected):
        np.testing.assert_array_equal(got, want)
    everyone = hvd.allgather_object([w.tolist() for w in expected])   # all done reading
    assert all(weights == everyone[0] for weights in everyone)
    if hvd.rank() == 0:
        shutil.rmtree(directory)



def trained_model(seed, optimizer=None):
    """make_model(seed) after one step of training, which builds its optimizer."""
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    model = make_model(seed)
    optimizer = optimizer or hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(np.ones((4, 5), np.float32), np.ones((4, 2), np.float32), verbose=0)
    return model


def training_state(model):
    return model.get_weights() + [np.array(v) for v in model.optimizer.variables]


def assert_unchanged_on_every_rank(model, before):
    unchanged = all(np.array_equal(got, want)
                    for got, want in zip(training_state(model), before))
    everyone = hvd.allgather_object(unchanged)         # so that no rank fails alone
    assert all(everyone), f"unchanged, by rank: {everyone}"


@mpi_test(env=TF_ENV, timeout=180)
def test_a_checkpoint_that_does_not_fit_changes_no_rank():
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    model = trained_model(hvd.rank())
    before = training_state(model)
    other_optimizer = trained_model(100, keras.optimizers.SGD(0.1, momentum=0.9))
    hvd.save_checkpoint(os.path.join(directory, "other-optimizer.npz"), other_optimizer)
    wider = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    hvd.save_checkpoint(os.path.join(directory, "other-model.npz"), wider)
    for name, error in [("other-optimizer.npz", "the checkpoint holds .* optimizer "
                                                "variables, the optimizer has"),
                        ("other-model.npz", "model variable .* has shape")]:
        with pytest.raises(hvd.CheckpointError, match=f"loading checkpoint "
                           f".*{name} failed on rank 0: .*{error}"):
            hvd.load_checkpoint(os.path.join(directory, name), model)
        assert_unchanged_on_every_rank(model, before)
    if hvd.rank() == 0:               # every rank is past the allgather: done reading
        shutil.rmtree(directory)


@mpi_test(env=TF_ENV, timeout=180)
def test_a_damaged_checkpoint_is_refused_on_every_rank():
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    path = os.path.join(directory, "ckpt.npz")
    model = trained_model(hvd.rank())
    before = training_state(model)
    hvd.save_checkpoint(path, trained_model(100))
    if hvd.rank() == 0:
        flip_byte_in_the_middle(path)
    with pytest.raises(hvd.CheckpointError, match="loading checkpoint .* failed on rank "
                       f"0: .*{re.escape(path)} is corrupt: its SHA-256"):
        hvd.load_checkpoint(path, model)
    assert_unchanged_on_every_rank(model, before)
    if hvd.rank() == 0:
        shutil.rmtree(directory)
