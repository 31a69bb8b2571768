"""Training throughput of a Keras application model on random images, in
images/sec per rank and in total, with mpitrain.tensorflow averaging the
gradients of a custom training step.

    .venv/bin/mpitrainrun -np 2 python examples/tensorflow2_synthetic_benchmark.py

The same measurement as Horovod's TensorFlow 2 synthetic benchmark: a
tf.function step through DistributedGradientTape, warm-up batches, then
iterations of several batches each; every figure is the mean over iterations
+- 1.96 standard deviations. The model is built without pretrained weights,
so nothing is downloaded, and the defaults are sized for a CPU.
"""

import argparse
import os
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")     # before TensorFlow loads

import keras
import numpy as np
import tensorflow as tf

import mpitrain.tensorflow as hvd


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ResNet50",
                        help="a model of keras.applications, e.g. ResNet50, MobileNetV2")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--image-size", type=int, default=64, help="at least 32")
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send the gradients as float16")
    args = parser.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    model = getattr(keras.applications, args.model)(
        weights=None, input_shape=(args.image_size, args.image_size, 3))
    optimizer = keras.optimizers.SGD(0.01 * hvd.size())
    optimizer.build(model.trainable_variables)
    # Start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(optimizer.variables, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    images = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    labels = tf.random.uniform([args.batch_size], maxval=1000, dtype=tf.int64)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                labels, model(images, training=True)))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    def say(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    say(f"model {args.model}, batch size {args.batch_size} per rank, "
        f"{args.image_size}x{args.image_size} images, {hvd.size()} ranks, "
        f"{'fp16' if args.fp16_allreduce else 'fp32'} gradients")
    say(f"warming up: {args.num_warmup_batches} batches")
    timeit.timeit(train_step, number=args.num_warmup_batches)
    rates = []                                  # per iteration: every rank's rate
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(train_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        rates.append(hvd.allgather(tf.constant([rate]), name="rate").numpy())
        say(f"iteration {iteration}: {rates[-1].mean():.1f} images/sec per rank")
    rates = np.array(rates)
    per_rank, total = rates.mean(axis=1), rates.sum(axis=1)
    say(f"images/sec per rank: {per_rank.mean():.1f} +-{1.96 * per_rank.std():.1f}")
    say(f"total images/sec on {hvd.size()} ranks: {total.mean():.1f} "
        f"+-{1.96 * total.std():.1f}")


if __name__ == "__main__":
    main()
