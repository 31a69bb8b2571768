"""Handwritten digits with Keras in mixed precision: mixed_float16 and a
LossScaleOptimizer inside mpitrain's DistributedOptimizer.

    .venv/bin/mpitrainrun -np 2 python examples/keras_mixed_precision_digits.py

The network, data and shards of keras_digits.py, computed in float16 with
float32 weights. The DistributedOptimizer wraps the LossScaleOptimizer (not
the other way round, which mpitrain refuses): gradients are averaged before
the scaler's finite check, so an overflow on any rank skips the step on
every rank. The last layer computes in float32, as Keras advises.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")     # before TensorFlow loads

import keras
import numpy as np
import tensorflow as tf

import mpitrain.tensorflow.keras as hvd
from keras_digits import network, shards


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="for one rank")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(hvd.rank())   # the broadcast callback makes weights equal
    (train_x, train_y), (test_x, test_y) = shards()

    model = keras.Sequential([network(), keras.layers.Activation("linear", dtype="float32")])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9)))
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train_x, train_y, batch_size=args.batch_size, epochs=args.epochs,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)], verbose=0)

    predictions = model.predict(test_x, batch_size=256, verbose=0).argmax(axis=1)
    counts = np.array([(predictions == test_y).sum(), len(test_y)], np.float64)
    right, seen = hvd.allreduce(counts, op=hvd.Sum, name="test.correct").numpy()
    if hvd.rank() == 0:
        print(f"loss scale: {float(optimizer.dynamic_scale.numpy()):g}")
        print(f"test accuracy: {right / seen:.2f}")


if __name__ == "__main__":
    main()
