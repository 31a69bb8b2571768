"""Does the machine switch between speeds while one process runs? (issue 30)

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/machine_states.py
                 [--blocks 16] [--pause 1.0] [--set geometric]

A launch of allreduce.py lasts a few seconds, and its repetitions agree
with each other while launches differ: that looks like something decided
once per launch (memory placement, threads, routes). This keeps one launch,
with the same arrays, shared-memory segment, buffers and threads
throughout, and measures in blocks separated by --pause seconds in which
every rank sleeps (its CPU idles). Each block prints the medians of:
  cross-core  one raw in-place MPI Allreduce of 512 KiB (30 calls): data
              that stays in cache, so its time is the cost of moving cache
              lines between the ranks' cores, Open MPI's code, not ours;
  mpitrain    the set reduced in place through mpitrain (5 steps);
  raw         one raw in-place MPI Allreduce of the set's bytes (3 calls).
Where mpitrain's time changes between blocks with nothing in the process
changed, the change is the machine's; where it follows the cross-core time,
it is the cost of crossing between cores that changed.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from allreduce import mpitrain_in_place, raw, slowest
from models import SETS, gradient_set

KiB = 1 << 10


def block(world, probe, step, whole, pause):
    time.sleep(pause)
    world.Barrier()
    return (statistics.median(slowest(world, probe) for _ in range(30)),
            statistics.median(slowest(world, step) for _ in range(5)),
            statistics.median(slowest(world, whole) for _ in range(3)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--pause", type=float, default=1.0,
                        help="seconds every rank sleeps before each block")
    parser.add_argument("--set", choices=SETS, default="geometric")
    args = parser.parse_args()
    mt.init()
    world = MPI.COMM_WORLD
    arrays = gradient_set(args.set)
    probe = raw(world, np.ones(512 * KiB // 4, np.float32))
    step = mpitrain_in_place(arrays, args.set)
    whole = raw(world, np.ones(sum(a.size for a in arrays), np.float32))
    step()
    if world.rank == 0:
        print(f"{world.size} ranks, {args.set} set in place, blocks after {args.pause} s "
              "idle:\n  block  cross-core us  mpitrain ms  raw ms")
    for index in range(args.blocks):
        cross, ours, theirs = block(world, probe, step, whole, args.pause)
        if world.rank == 0:
            print(f"  {index:5d}  {cross * 1e6:13.0f}  {ours * 1e3:11.1f}  "
                  f"{theirs * 1e3:6.1f}", flush=True)


if __name__ == "__main__":
    main()
