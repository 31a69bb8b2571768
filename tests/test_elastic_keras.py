"""hvd.elastic for Keras in a fixed MPI world: a reset resumes fit exactly."""

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")
import keras

import mpitrain.tensorflow as hvd_tf  # noqa: E402
import mpitrain.tensorflow.keras as hvd
from tests.keras_models import compiled_model  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
EPOCHS, STEPS, BATCH = 3, 4, 4


class FailOnce(keras.callbacks.Callback):
    """Raises a recoverable error once, on the last rank, in the middle of epoch 1."""

    def __init__(self, state):
        super().__init__()
        self.state, self.failed = state, False

    def on_train_batch_end(self, batch, logs=None):
        if (hvd.rank() == hvd.size() - 1 and self.state.epoch == 1 and batch == 1
                and not self.failed):
            self.failed = True
            raise hvd.HorovodInternalError("lost a batch (raised on purpose)")


@mpi_test(env=TF_ENV, timeout=180)
def test_a_reset_in_the_middle_of_an_epoch_resumes_fit_from_the_last_commit():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(STEPS * BATCH, 5)).astype(np.float32)
    y = rng.normal(size=(STEPS * BATCH, 2)).astype(np.float32)

    reference = compiled_model(0)
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)

    model = compiled_model(hvd.rank())          # sync() gives every rank rank 0's
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    resumed_at = []
    state.register_reset_callbacks([lambda: resumed_at.append((state.epoch, state.batch))])
    callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=STEPS),
                 FailOnce(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch,
                        shuffle=False, verbose=0, callbacks=callbacks)

    train(state)
    assert resumed_at == [(1, 0)]               # back to the end of epoch 0
    assert state.epoch == EPOCHS
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)


@mpi_test(env=TF_ENV, timeout=180)
def test_a_state_needs_a_built_model():
    with pytest.raises(ValueError, match="built model"):
        hvd.elastic.KerasState(keras.Sequential([keras.layers.Dense(2)]))


@mpi_test(env=TF_ENV, timeout=180)
def test_restore_after_sync_brings_back_the_synced_variables():
    # Horovod's test_elastic_state: sync() commits what it synchronized.
    r = hvd.rank()
    model = compiled_model(r)
    variables = [tf.Variable(np.full((2, 2), float(r + 1))), tf.Variable(float(r + 1))]
    for state, tracked in ((hvd.elastic.KerasState(model, epoch=10 + r), model.variables),
                           (hvd_tf.elastic.TensorFlowState(variables, epoch=10 + r),
                            variables)):
        state.sync()
        synced = [np.array(v) for v in tracked]
        everyone = hvd.allgather_object([v.tolist() for v in synced])
        assert all(values == everyone[0] for values in everyone)    # rank 0's
        for variable in tracked:
            variable.assign(variable + 5)
        state.epoch = 99
        state.restore()
        restored = [np.array_equal(np.array(v), value) for v, value in zip(tracked, synced)]
        # every rank fails together, naming the ranks that got their own values back
        assert hvd.allgather_object(restored) == [[True] * len(synced)] * hvd.size()
        assert state.epoch == 10
