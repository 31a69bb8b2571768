"""Keras checkpoints: resuming gives what training straight through gives."""

import os
import shutil
import tempfile

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")

import mpitrain.tensorflow.keras as hvd
from tests.keras_models import compiled_model  # noqa: E402

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
