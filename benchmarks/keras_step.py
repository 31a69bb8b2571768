"""What DistributedOptimizer adds to a Keras training step, and where it goes.

Run on 2 ranks:

    mpirun -np 2 python benchmarks/keras_step.py [--rounds 15] [--batch 32]

One run measures, alternating in rounds so that load changes hit all alike
(medians over rounds; each round's time is the slower rank's):

  plain step   model.train_on_batch with a plain SGD (no communication)
  plain+sync   the same followed by a barrier: ranks wait for the slower one
               each step, as any synchronous data-parallel step does
  dist step    the same model with hvd.DistributedOptimizer(SGD)
  tf op        the gradient allreduce alone, as the step runs it: one op in a
               tf.function on tensors shaped like the gradients
  numpy body   what that op runs on numpy arrays (GradientReducer.reduce_arrays):
               a grouped allreduce streamed through shared memory where the
               job streams, else a pack (averaging folded in) into a reused
               buffer and the core's allreduce in place
  raw MPI      mpi4py Allreduce (in place) of the same bytes, one buffer,
               in one call and in the core's chunks (MPITRAIN_CHUNK_SIZE);
               the faster of the two is the floor

so that dist - plain+sync is the cost of communication per step, tf op -
numpy body the cost of crossing between TensorFlow and numpy, numpy body -
raw MPI the engine's own cost (and the packing copy, where it packs), and
raw MPI the floor.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpitrain.runtime.config import Config  # noqa: E402
import mpitrain.tensorflow.keras as hvd  # noqa: E402
from mpitrain.tensorflow.gradient_reduction import GradientReducer  # noqa: E402


def build_model(optimizer, width, features):
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,))] +
                             [keras.layers.Dense(width, activation="relu") for _ in range(3)] +
                             [keras.layers.Dense(10)])
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  jit_compile=False)
    return model


def slowest(seconds, comm):
    return comm.allreduce(seconds, op=MPI.MAX)


def timed(function, repeats, comm):
    """Median over ``repeats`` calls, after a barrier, of the slower rank's time."""
    comm.Barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return slowest(statistics.median(times), comm)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="calls per case per round")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--features", type=int, default=1024)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    import keras
    comm = MPI.COMM_WORLD.Dup()          # the benchmark's own traffic, apart from mpitrain's
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(args.batch, args.features)).astype(np.float32)
    y = rng.integers(0, 10, size=args.batch)

    plain = build_model(keras.optimizers.SGD(0.01), args.width, args.features)
    dist = build_model(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), args.width,
                       args.features)
    shapes = [tuple(v.shape) for v in dist.trainable_variables]
    count = sum(int(np.prod(s)) for s in shapes)
    gradients = [tf.ones(s) for s in shapes]
    reducer = GradientReducer()
    tf_op = tf.function(lambda grads: reducer.reduce(grads))
    arrays = [np.ones(s, np.float32) for s in shapes]
    buffer = np.ones(count, np.float32)
    step = Config().chunk_size // buffer.itemsize
    chunks = [buffer[i:i + step] for i in range(0, count, step)]

    cases = {
        "plain step": lambda: plain.train_on_batch(x, y),
        "plain+sync": lambda: (plain.train_on_batch(x, y), comm.Barrier()),
        "dist step": lambda: dist.train_on_batch(x, y),
        "tf op": lambda: tf_op(gradients),      # eager results: the op has run
        "numpy body": lambda: reducer.reduce_arrays(arrays, "benchmark.numpy"),
        "raw MPI 1 call": lambda: comm.Allreduce(MPI.IN_PLACE, buffer),
        "raw MPI chunks": lambda: [comm.Allreduce(MPI.IN_PLACE, c) for c in chunks],
    }
    for function in cases.values():            # warm up: tracing, buffers, caches
        for _ in range(2):
            function()
    results = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, function in cases.items():
            results[name].append(timed(function, args.repeats, comm))
    median = {name: statistics.median(values) * 1e3 for name, values in results.items()}

    if hvd.rank() == 0:
        raw = min(median["raw MPI 1 call"], median["raw MPI chunks"])
        overhead = median["dist step"] - median["plain+sync"]
        print(f"model: {count / 1e6:.2f}M parameters in {len(shapes)} tensors "
              f"({count * 4 / 2**20:.1f} MiB float32); {hvd.size()} ranks, "
              f"batch {args.batch} per rank; medians of {args.rounds} rounds x "
              f"{args.repeats} calls, slower rank")
        for name, value in median.items():
            print(f"  {name:<15} {value:8.2f} ms")
        print(f"dist - plain (all that DistributedOptimizer adds): "
              f"{median['dist step'] - median['plain step']:8.2f} ms")
        print(f"dist - plain+sync (communication per step):       {overhead:8.2f} ms "
              f"= raw MPI x {overhead / raw:.2f}")
        print(f"  TensorFlow <-> numpy (tf op - numpy body):       "
              f"{median['tf op'] - median['numpy body']:8.2f} ms")
        print(f"  engine and packing (numpy body - raw MPI):       "
              f"{median['numpy body'] - raw:8.2f} ms")
        print(f"  MPI (raw Allreduce of the same bytes):           {raw:8.2f} ms")
        print(f"  rest (dist - plain+sync - tf op):                "
              f"{overhead - median['tf op']:8.2f} ms")
    comm.Free()


if __name__ == "__main__":
    main()
