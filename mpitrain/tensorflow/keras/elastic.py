"""Horovod's ``hvd.elastic`` for Keras.

``KerasState(model, epoch=0, batch=0)`` commits and restores the model's and
its optimizer's variables with plain values; the callbacks keep
``state.epoch`` and ``state.batch`` current and commit; ``run`` retries after
a recoverable error as mpitrain.api.elastic.run does (see there and
docs/fault-tolerance.md). Inside a compiled train step a collective's error
reaches Python as a tf.errors.OpError carrying mpitrain's message, which
run() reads to tell a reset from a fatal shutdown.

Keras 3 cannot start an epoch in its middle, so a reset goes back to the
start of the epoch being trained: commit at epoch ends
(``CommitStateCallback(state, batches_per_commit=steps_per_epoch)``) and pass
``epochs=total - state.epoch`` to fit, and training resumes exactly.
"""

import numpy as np
import tensorflow as tf

from mpitrain.api import elastic
from mpitrain.errors import HorovodInternalError
from mpitrain.tensorflow.broadcast import broadcast_variables
from mpitrain.tensorflow.keras.variables import optimizer_variables


class VariablesState(elastic.State):
    """TensorFlow variables, which a subclass's ``_variables()`` lists, committed
    with plain values.

    sync() also saves what it synchronized, as Horovod does: a restore()
    after it brings back rank 0's variables, not this rank's from before.
    """

    def _save_variables(self):
        self._saved_variables = [np.array(v) for v in self._variables()]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        for variable, value in zip(self._variables(), self._saved_variables):
            variable.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self._variables(), root_rank=0)
        self._save_variables()
        super().sync()


class TensorFlowKerasState(VariablesState):
    """A built Keras model, its optimizer's variables and plain values, committed together."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("TensorFlowKerasState needs a built model: give it an "
                             "Input layer, call model.build(input_shape), or call it "
                             "on a batch first")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        if self.optimizer is not None and not getattr(self.optimizer, "built", True):
            # Built now, so that the first commit already holds its variables.
            self.optimizer.build(model.trainable_variables)
        super().__init__(**kwargs)

    def _variables(self):
        return list(self.model.variables) + optimizer_variables(self.optimizer)


class KerasState(TensorFlowKerasState):
    """Horovod's name for the state in horovod.tensorflow.keras.elastic."""


def _recoverable(error):
    if isinstance(error, tf.errors.OpError) and not isinstance(error, HorovodInternalError):
        return elastic.mentions_only_resets(error.message)
    return elastic.is_recoverable(error)


run = elastic.run_with(_recoverable)


def _last_batch_of_epoch(callback, batch):
    steps = callback.params.get("steps") if callback.params else None
    return steps is not None and batch + 1 == steps


class CommitStateCallback(tf.keras.callbacks.Callback):
    """Commit the state every ``batches_per_commit`` batches.

    Put it after UpdateBatchStateCallback and UpdateEpochStateCallback, so
    that each commit holds the batch and epoch it belongs to.
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_left = batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_left -= 1
        if self.batches_left == 0:
            self.commit()
            self.batches_left = self.batches_per_commit

    def commit(self):
        self.state.commit()


class UpdateBatchStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.batch``: the batches of the current epoch done so far."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = 0 if _last_batch_of_epoch(self, batch) else batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.epoch``: the epochs done, counting those before this fit().

    It counts the epochs each fit() completes, so it works with
    ``epochs=total - state.epoch`` and with ``initial_epoch=state.epoch``.
    The epoch counts as done from its last batch on (where the steps per
    epoch are known), so a commit made there resumes after it.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_begin(self, logs=None):
        self.first_epoch = self.state.epoch
        self.completed = 0

    def on_train_batch_end(self, batch, logs=None):
        if _last_batch_of_epoch(self, batch):
            self.state.epoch = self.first_epoch + self.completed + 1

    def on_epoch_end(self, epoch, logs=None):
        self.completed += 1
        self.state.epoch = self.first_epoch + self.completed
