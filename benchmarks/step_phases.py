"""Where the time of one step of allreduce_async calls goes, phase by phase.

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/step_phases.py [--steps 300]

For the two target sets of benchmarks/allreduce.py (200 x 16 KiB; about 120
tensors of 64 MiB in all), in place and out of place, a step submits every
tensor with allreduce_async and synchronizes them all. The engine's phases
are timed by wrapping its methods with clocks (the wrapping adds about a
microsecond per phase, nothing per tensor): the submissions, the round up
to the control allreduce (sorting the entries, cache lookups), the control
allreduce and the arrival, setting up the group, the reduction itself, and
the completion until the last synchronize returns. Each phase is printed
as the median, over steps, of when it starts and ends after the step
began, on rank 0, beside one raw in-place Allreduce of the same bytes.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from mpitrain.engine import controller, executor
from mpitrain.transport.channel import Channel

from allreduce import model_like

MARKS = []


def _marking(label, function, generator):
    """function, marking label + "<" when it starts and label + ">" when it ends."""
    if generator:
        def wrapped(*args, **kwargs):
            MARKS.append((label + "<", time.perf_counter()))
            result = yield from function(*args, **kwargs)
            MARKS.append((label + ">", time.perf_counter()))
            return result
    else:
        def wrapped(*args, **kwargs):
            MARKS.append((label + "<", time.perf_counter()))
            result = function(*args, **kwargs)
            MARKS.append((label + ">", time.perf_counter()))
            return result
    return wrapped


def instrument():
    for owner, method, label, generator in (
            (controller.SetController, "_round", "round", True),
            (Channel, "round", "control allreduce", True),
            (Channel, "arrive", "arrival", True),
            (executor.Executor, "_allreduce", "group", True),
            (Channel, "allreduce", "reduction", True),
            (controller, "notify_waiters", "publish", False)):
        setattr(owner, method, _marking(label, getattr(owner, method), generator))


def step(arrays, prefix, in_place, held):
    MARKS.append(("submit<", time.perf_counter()))
    handles = [mt.allreduce_async(a, name=f"{prefix}.{i}", op=mt.Sum,
                                  output=a if in_place else None)
               for i, a in enumerate(arrays)]
    MARKS.append(("submit>", time.perf_counter()))
    held[:] = [mt.synchronize(handle) for handle in handles]
    MARKS.append(("synchronized>", time.perf_counter()))


def phases(world, arrays, prefix, in_place, steps):
    """{mark: median microseconds after the step began}, first occurrence per step."""
    held = []
    for _ in range(10):
        step(arrays, prefix, in_place, held)
    offsets = {}
    for _ in range(steps):
        world.Barrier()
        MARKS.clear()
        start = time.perf_counter()
        step(arrays, prefix, in_place, held)
        seen = {}
        for label, when in MARKS:
            seen.setdefault(label, when)
        for label, when in seen.items():
            offsets.setdefault(label, []).append((when - start) * 1e6)
    return {label: statistics.median(values) for label, values in offsets.items()}


def raw_us(world, nbytes, steps):
    buffer = np.ones(nbytes // 4, np.float32)
    times = []
    for _ in range(steps):
        world.Barrier()
        start = time.perf_counter()
        world.Allreduce(MPI.IN_PLACE, buffer)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def report(title, marks, raw):
    print(f"\n{title}: median µs after the step began (rank 0); one raw in-place "
          f"Allreduce of the same bytes: {raw:.0f} µs")
    ordered = sorted(marks.items(), key=lambda item: item[1])
    for label, offset in ordered:
        print(f"  {label:22s} {offset:8.0f}")
    total = marks["synchronized>"]
    print(f"  step / raw = {total / raw:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    instrument()
    mt.init()
    world = MPI.COMM_WORLD
    sets = {"200 x 16 KiB": [np.ones(4096, np.float32) for _ in range(200)],
            "120 tensors, 64 MiB": model_like(64 << 20)}
    for arrays in sets.values():
        for array in arrays:
            array[:] = 0          # sums of zeros stay finite step after step
    for title, arrays in sets.items():
        nbytes = sum(a.nbytes for a in arrays)
        steps = args.steps if nbytes < (16 << 20) else max(5, args.steps // 20)
        raw = raw_us(world, nbytes, steps)
        for in_place in (True, False):
            marks = phases(world, arrays, f"{title}.{in_place}", in_place, steps)
            if world.rank == 0:
                report(f"{title}, {'in place' if in_place else 'out of place'}",
                       marks, raw)
    mt.shutdown()


if __name__ == "__main__":
    main()
