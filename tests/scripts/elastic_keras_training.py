"""A Horovod Keras elastic script (KerasState and its callbacks, committing at
each epoch's end as Keras 3 needs), for tests/test_elastic_hosts.py.

    elastic_keras_training.py OUT [--kill-at E:B] [--start-from FILE]

Rank 0 saves the weights and optimizer variables it is about to commit to
OUT/commit-r<restarts>-e<epoch>.npz, and the final weights to OUT/final.npz.
In the job's first run, --kill-at SIGKILLs the last rank after batch B of
epoch E (from 0). --start-from loads a saved commit first: a reference run,
under plain mpirun.
"""

import argparse
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
import tensorflow as tf  # noqa: E402

import mpitrain.tensorflow.keras as hvd  # noqa: E402
from tests.keras_models import compiled_model  # noqa: E402

EPOCHS, BATCH, SAMPLES = 3, 4, 48

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--kill-at")
parser.add_argument("--start-from")
args = parser.parse_args()

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
hvd.init()
data = np.random.default_rng(7)
x = data.normal(size=(SAMPLES, 5)).astype(np.float32)[hvd.rank()::hvd.size()]
y = data.normal(size=(SAMPLES, 2)).astype(np.float32)[hvd.rank()::hvd.size()]
model = compiled_model(hvd.rank())          # the first sync gives every rank rank 0's
epoch = 0
if args.start_from:
    saved = np.load(args.start_from)
    model.optimizer.build(model.trainable_variables)
    for variable, value in zip(model.variables + list(model.optimizer.variables),
                               [saved[f"arr_{i}"] for i in range(len(saved.files) - 1)]):
        variable.assign(value)
    epoch = int(saved[f"arr_{len(saved.files) - 1}"])
state = hvd.elastic.KerasState(model, epoch=epoch, batch=0)
first_run = state.restarts == 0 and not args.start_from
steps = -(-len(x) // BATCH)


class SaveCommit(tf.keras.callbacks.Callback):
    """Before the commit at the end of an epoch, rank 0 saves what it holds."""

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == steps and hvd.rank() == 0:
            np.savez(os.path.join(args.out, f"commit-r{state.restarts}-e{state.epoch}.npz"),
                     *[np.array(v) for v in model.variables + list(model.optimizer.variables)],
                     state.epoch)


class Kill(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if first_run and args.kill_at == f"{state.epoch}:{batch}" \
                and hvd.rank() == hvd.size() - 1:
            print(f"rank {hvd.rank()} killed at epoch {state.epoch} batch {batch}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state), SaveCommit(),
             hvd.elastic.CommitStateCallback(state, batches_per_commit=steps), Kill()]


@hvd.elastic.run
def train(state):
    state.model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch, shuffle=False,
                    verbose=0, callbacks=callbacks)


train(state)
if hvd.rank() == 0:
    np.savez(os.path.join(args.out, "final.npz"), *model.get_weights())
    print(f"finished with {hvd.size()} ranks after {state.restarts} restarts", flush=True)
