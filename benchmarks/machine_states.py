"""Does the machine switch between speeds while one process runs? (issue 30)

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/machine_states.py
                 [--blocks 16] [--pause 1.0] [--set geometric] [--chunks]

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
  raw         one raw in-place MPI Allreduce of the set's bytes (3 calls);
  chunks      with --chunks, the shared-memory allreduce alone
              (mpitrain.transport.shm) of the set's bytes in place, with
              chunks of 256 KiB, 1 MiB (the default), 4 MiB and 16 MiB
              (3 calls each): which chunk size suits which state.
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
from mpitrain.transport.shm import SharedMemoryAllreduce
from shm_allreduce import shared_in_place

KiB, MiB = 1 << 10, 1 << 20
CHUNKS = [256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]


def block(world, pause, probe, step, whole, chunked):
    """Medians of each variant, after every rank slept ``pause`` seconds."""
    time.sleep(pause)
    world.Barrier()
    return ([statistics.median(slowest(world, probe) for _ in range(30)),
             statistics.median(slowest(world, step) for _ in range(5)),
             statistics.median(slowest(world, whole) for _ in range(3))]
            + [statistics.median(slowest(world, call) for _ in range(3))
               for call in chunked])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--pause", type=float, default=1.0,
                        help="seconds every rank sleeps before each block")
    parser.add_argument("--set", choices=SETS, default="geometric")
    parser.add_argument("--chunks", action="store_true",
                        help="also the shared-memory allreduce alone, by chunk size")
    args = parser.parse_args()
    mt.init()
    world = MPI.COMM_WORLD
    arrays = gradient_set(args.set)
    probe = raw(world, np.ones(512 * KiB // 4, np.float32))
    step = mpitrain_in_place(arrays, args.set)
    buffer = np.zeros(sum(a.size for a in arrays), np.float32)   # sums stay finite
    whole = raw(world, buffer)
    chunked = [shared_in_place(SharedMemoryAllreduce(world, chunk), buffer)
               for chunk in (CHUNKS if args.chunks else [])]
    step()
    columns = ["block", "cross-core us", "mpitrain ms", "raw ms"] + [
        f"shm {chunk // KiB} KiB ms" for chunk in CHUNKS[:len(chunked)]]
    if world.rank == 0:
        print(f"{world.size} ranks, {args.set} set in place, blocks after {args.pause} s "
              "idle:\n  " + "  ".join(columns))
    for index in range(args.blocks):
        cross, *times = block(world, args.pause, probe, step, whole, chunked)
        if world.rank == 0:
            cells = [str(index), f"{cross * 1e6:.0f}"] + [f"{t * 1e3:.1f}" for t in times]
            print("  " + "  ".join(cell.rjust(len(name)) for cell, name in zip(cells, columns)),
                  flush=True)


if __name__ == "__main__":
    main()
