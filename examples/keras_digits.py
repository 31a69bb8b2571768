"""Handwritten digits with Keras model.fit on every rank, through
mpitrain.tensorflow.keras.

    .venv/bin/mpitrainrun -np 2 python examples/keras_digits.py

scikit-learn ships the data (1797 images of 8x8 pixels), so nothing is
downloaded. Each rank fits on its own shard of the training images;
DistributedOptimizer averages the gradients, so every rank holds the same
weights. The test images are split across the ranks too, and the correct
answers are summed over all of them.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")     # before TensorFlow loads

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm.keras import TqdmCallback

import mpitrain.tensorflow.keras as hvd


def shards():
    digits = load_digits()
    images = (digits.images[..., np.newaxis] / 16.0).astype(np.float32)
    train_x, test_x, train_y, test_y = train_test_split(
        images, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    # Equal shards: a rank with one batch more would wait for partners that
    # have finished their epoch.
    per_rank = len(train_x) // hvd.size()
    train = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    test = slice(hvd.rank(), None, hvd.size())
    return (train_x[train], train_y[train]), (test_x[test], test_y[test])


def network():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="for one rank")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(hvd.rank())   # the broadcast callback makes weights equal
    (train_x, train_y), (test_x, test_y) = shards()

    model = network()
    # The global batch grows with the ranks; so does the learning rate.
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    if hvd.rank() == 0:
        # After the averaging: shows the means. Given the epochs, it draws no
        # empty bar before Keras tells it how many there are.
        callbacks.append(TqdmCallback(epochs=args.epochs, verbose=0))
    model.fit(train_x, train_y, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=0)

    predictions = model.predict(test_x, batch_size=256, verbose=0).argmax(axis=1)
    counts = np.array([(predictions == test_y).sum(), len(test_y)], np.float64)
    right, seen = hvd.allreduce(counts, op=hvd.Sum, name="test.correct").numpy()
    if hvd.rank() == 0:
        print(f"test accuracy: {right / seen:.2f}")


if __name__ == "__main__":
    main()
