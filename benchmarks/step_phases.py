"""Where the time of one step of allreduce_async calls goes, phase by phase.

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/step_phases.py [--steps 300]
                 [--sets resnet50 bert gpt2 geometric small]

For the target sets of benchmarks/allreduce.py (the gradients of real
models, benchmarks/models.py, and 200 x 16 KiB), in place and out of place,
a step submits every tensor with allreduce_async and synchronizes them all.
The engine's phases are timed by wrapping its methods with clocks (the
wrapping adds about a microsecond per phase, nothing per tensor): the
submissions, the round up to the control allreduce (sorting the entries,
cache lookups), the control allreduce and the arrival, setting up each
group, the reduction itself (by MPI or through shared memory), and the
completion until the last synchronize returns. Each phase is printed as
the median, over steps, of when it first starts and last ends after the
step began, the time spent inside it and how often it is entered, on rank
0, beside one raw in-place Allreduce of the same bytes.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from mpitrain.engine import controller
from mpitrain.engine.execution import executor
from mpitrain.transport.channel import Channel

from allreduce import target_sets
from models import SETS

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
            (Channel, "allreduce", "reduction (MPI)", True),
            (Channel, "allreduce_by_host_reducer", "reduction (shared memory)", True),
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
    """{label: (first start, last end, time inside, times entered)}, medians
    over steps in microseconds after the step began; a phase entered several
    times a step (a round per group of tensors ready together) spans from
    its first start to its last end, and its time inside is the sum."""
    held = []
    for _ in range(10):
        step(arrays, prefix, in_place, held)
    figures = {}
    for _ in range(steps):
        world.Barrier()
        MARKS.clear()
        start = time.perf_counter()
        step(arrays, prefix, in_place, held)
        seen = {}
        for label, when in MARKS:
            phase, edge = label[:-1], label[-1]
            first, last, inside, count, opened = seen.get(phase, (when, when, 0.0, 0, None))
            if edge == "<":
                seen[phase] = (first, last, inside, count + 1, when)
            else:
                seen[phase] = (first, when, inside + when - (opened or first), count, None)
        for phase, (first, last, inside, count, _) in seen.items():
            figures.setdefault(phase, []).append(
                ((first - start) * 1e6, (last - start) * 1e6, inside * 1e6, count))
    return {phase: tuple(statistics.median(column) for column in zip(*values))
            for phase, values in figures.items()}


def raw_us(world, nbytes, steps):
    buffer = np.ones(nbytes // 4, np.float32)
    times = []
    for _ in range(steps):
        world.Barrier()
        start = time.perf_counter()
        world.Allreduce(MPI.IN_PLACE, buffer)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def report(title, figures, raw):
    print(f"\n{title}: medians over steps, µs after the step began (rank 0); one raw "
          f"in-place Allreduce of the same bytes: {raw:.0f} µs")
    print(f"  {'phase':26s} {'from':>8s} {'to':>8s} {'inside':>8s} {'times':>6s}")
    for phase, (first, last, inside, count) in sorted(figures.items(),
                                                      key=lambda item: item[1][0]):
        print(f"  {phase:26s} {first:8.0f} {last:8.0f} {inside:8.0f} {count:6.0f}")
    print(f"  step / raw = {figures['synchronized'][1] / raw:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300,
                        help="steps of sets under 16 MiB; a twentieth of it for larger")
    parser.add_argument("--sets", nargs="+", choices=SETS + ("small",),
                        default=list(SETS) + ["small"])
    args = parser.parse_args()
    instrument()
    mt.init()
    world = MPI.COMM_WORLD
    for title, arrays, _ in target_sets(args.sets):
        for array in arrays:
            array[:] = 0          # sums of zeros stay finite step after step
        nbytes = sum(a.nbytes for a in arrays)
        steps = args.steps if nbytes < (16 << 20) else max(5, args.steps // 20)
        raw = raw_us(world, nbytes, steps)
        for in_place in (True, False):
            marks = phases(world, arrays, f"{title.split(':')[0]}.{in_place}",
                           in_place, steps)
            if world.rank == 0:
                report(f"{title}, {'in place' if in_place else 'out of place'}",
                       marks, raw)
    mt.shutdown()


if __name__ == "__main__":
    main()
