"""mpitrain's allreduce against one raw mpi4py Allreduce of the same bytes.

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/allreduce.py

Cases (each timed as the slowest rank, medians over alternated repetitions):
  model-like: ~120 float32 gradients totalling 64 MiB, reduced in place
              (as DistributedOptimizer does), against one in-place
              Allreduce of a preallocated 64 MiB buffer;
  small:      200 tensors of 16 KiB against one Allreduce of 3.2 MB.
Then the CPU share of an idle engine over 10 s.
"""

import argparse
import resource
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpitrain as mt

MiB = 1 << 20


def model_like_sizes(total_bytes, count=120):
    """Weights of geometrically growing size and small biases, like a model."""
    weights = np.geomspace(16 * 1024, 4 * MiB, count // 2)
    weights *= (total_bytes - count // 2 * 4096) / weights.sum()
    sizes = []
    for weight in weights:
        sizes += [int(weight) // 4, 1024]
    sizes[0] += (total_bytes - 4 * sum(sizes)) // 4
    return sizes


def timed(fn, world):
    world.Barrier()
    start = time.perf_counter()
    fn()
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


def alternate(variants, world, repetitions):
    """Run each variant once per repetition, in turn; return medians in seconds."""
    times = {name: [] for name in variants}
    for name, fn in variants.items():            # warm-up: caches, buffers, pages
        fn()
    for _ in range(repetitions):
        for name, fn in variants.items():
            times[name].append(timed(fn, world))
    return {name: statistics.median(values) for name, values in times.items()}


def mpitrain_in_place(arrays, prefix):
    def run():
        handles = [mt.allreduce_async(a, name=f"{prefix}.{i}", op=mt.Sum, output=a)
                   for i, a in enumerate(arrays)]
        for handle in handles:
            mt.synchronize(handle)
    return run


def raw_allreduce(buffer, world):
    return lambda: world.Allreduce(MPI.IN_PLACE, buffer)


def idle_cpu_share(seconds):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before, start = usage.ru_utime + usage.ru_stime, time.monotonic()
    time.sleep(seconds)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime - before) / (time.monotonic() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=21)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()
    mt.init()
    world = MPI.COMM_WORLD.Dup()
    rows = []

    sizes = model_like_sizes(64 * MiB)
    model = [np.ones(n, np.float32) for n in sizes]
    result = alternate({"raw": raw_allreduce(np.ones(16 * MiB, np.float32), world),
                        "mpitrain": mpitrain_in_place(model, "model")},
                       world, args.repetitions)
    rows.append((f"{len(sizes)} tensors, 64 MiB in all", "1 x 64 MiB", result))

    small = [np.ones(4096, np.float32) for _ in range(200)]
    result = alternate({"raw": raw_allreduce(np.ones(200 * 4096, np.float32), world),
                        "mpitrain": mpitrain_in_place(small, "small")},
                       world, args.repetitions)
    rows.append(("200 tensors x 16 KiB", "1 x 3.2 MB", result))

    idle = idle_cpu_share(args.idle_seconds)
    idle_max = world.allreduce(idle, op=MPI.MAX)
    if world.rank == 0:
        print(f"mpitrain allreduce benchmark: {world.size} ranks, "
              f"{args.repetitions} alternated repetitions, medians of the slowest rank")
        print(f"{'case':<30} {'mpitrain':>10} {'raw mpi4py':>22} {'ratio':>7}")
        for case, baseline, result in rows:
            ratio = result["mpitrain"] / result["raw"]
            print(f"{case:<30} {result['mpitrain'] * 1e3:8.2f} ms "
                  f"{result['raw'] * 1e3:8.2f} ms ({baseline}) {ratio:6.2f}x")
        print(f"idle engine: {idle_max:.2%} of a core (busiest rank, "
              f"{args.idle_seconds:.0f} s)")


if __name__ == "__main__":
    main()
