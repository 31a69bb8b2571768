"""What op=Adasum costs against op=Sum on the same tensors.

Run on 2 or 4 ranks (say when they share cores):

    mpitrainrun -np 2 python benchmarks/adasum.py [--sizes-mib 4 64] [--repetitions 9]

For each total size, a model-like set of float32 tensors (benchmarks/
allreduce.py's model_like) is reduced in place with Sum and with Adasum,
the two taking turns so that both see the same machine state. Every figure
is the slowest rank's time; the ratio Adasum / Sum is taken per repetition
and printed as its median and range.
"""

import argparse
import os
import statistics
import sys

from mpi4py import MPI

import mpitrain as mt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import MiB, alternate_times, model_like  # noqa: E402


def in_place(arrays, prefix, op):
    def run():
        handles = [mt.allreduce_async(a, name=f"{prefix}.{i}", op=op, output=a)
                   for i, a in enumerate(arrays)]
        for handle in handles:
            mt.synchronize(handle)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--repetitions", type=int, default=9)
    args = parser.parse_args()
    mt.init()
    world = MPI.COMM_WORLD
    if world.rank == 0:
        print(f"{mt.size()} ranks; time of the slowest rank, median (range) of "
              f"{args.repetitions} repetitions")
    for size in args.sizes_mib:
        # In place, run after run: Sum doubles its arrays each time (finite far
        # beyond these repetitions), Adasum of equal inputs leaves them as they are.
        sum_arrays, adasum_arrays = model_like(size * MiB), model_like(size * MiB)
        times = alternate_times(world, {
            "Sum": in_place(sum_arrays, f"sum.{size}", mt.Sum),
            "Adasum": in_place(adasum_arrays, f"adasum.{size}", mt.Adasum)},
            args.repetitions)
        ratios = [a / s for a, s in zip(times["Adasum"], times["Sum"])]
        if world.rank == 0:
            line = f"{size:4d} MiB in {len(sum_arrays)} tensors:"
            for name, values in times.items():
                line += (f"  {name} {statistics.median(values) * 1e3:.1f} ms "
                         f"({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})")
            print(f"{line}  Adasum/Sum {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
    mt.shutdown()


if __name__ == "__main__":
    main()
