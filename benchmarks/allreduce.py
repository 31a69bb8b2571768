"""Allreduce speed: mpitrain against raw mpi4py and torch.distributed (gloo).

Run on 2 ranks (3 or more work too; say when they share cores):

    mpitrainrun -np 2 python benchmarks/allreduce.py [--out docs/benchmarks]

Every figure is the time of the slowest rank, the median of repetitions in
which the variants take turns, so all variants see the same machine state.
Sections:
  targets  the gradients of real models (benchmarks/models.py: ResNet-50,
           BERT-base, GPT-2 small, and a 64 MiB set whose tensor sizes grow
           geometrically) and 200 tensors of 16 KiB, each set reduced in both
           call forms: in place (output=a, as DistributedOptimizer does) and
           out of place (a new result per tensor, held until the next
           repetition as a user's loop holds it); both against one in-place
           Allreduce of a preallocated buffer of the same bytes. Times carry
           their range over repetitions, and ratios are taken per
           repetition, against that repetition's raw call, then summarised
           the same way. One launch is one sample of what is decided once per
           launch: benchmarks/launches.py runs several and reports the spread;
  sweep    bus bandwidth against message size for one tensor (mpitrain, raw
           mpi4py, gloo) and for the same bytes split like a model (mpitrain);
  idle     the CPU share of an idle rank over 10 s;
  memory   resident memory of a rank across 1000 steps of the geometric set,
           in place and out of place, counted from step 100 (allocations per
           step would show as growth), and the page faults per step.
With --out, also writes allreduce.md (tables) and allreduce.png (plot);
with --json, the targets' times per repetition.
"""

import argparse
import json
import os
import resource
import socket
import statistics
import time
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from models import SETS, describe, gradient_set

KiB, MiB = 1 << 10, 1 << 20
SWEEP = [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]


def model_like(total_bytes, count=120):
    """float32 arrays: weights of geometrically growing size and small biases."""
    count = max(2, min(count, total_bytes // 8192 * 2))
    weights = np.geomspace(1, 256, count // 2)
    weights *= (total_bytes - count // 2 * 4096) / weights.sum()
    sizes = []
    for weight in weights:
        sizes += [max(1, int(weight) // 4), 1024]
    sizes[0] += max(0, (total_bytes - 4 * sum(sizes)) // 4)
    return [np.ones(n, np.float32) for n in sizes]


def slowest(world, fn):
    """Seconds fn takes on the slowest rank. What fn returns is dropped only
    after the clock stops: freeing a previous repetition's results is not
    part of the call measured."""
    world.Barrier()
    start = time.perf_counter()
    to_drop = fn()
    elapsed = time.perf_counter() - start
    del to_drop
    return world.allreduce(elapsed, op=MPI.MAX)


def alternate_times(world, variants, repetitions):
    """Seconds of every repetition of variants run in turn, after one warm-up
    each; index i of every list is the same repetition."""
    for fn in variants.values():
        fn()
    times = {name: [] for name in variants}
    for _ in range(repetitions):
        for name, fn in variants.items():
            times[name].append(slowest(world, fn))
    return times


def alternate(world, variants, repetitions):
    """Medians (seconds) of variants run in turn, after one warm-up each."""
    return {name: statistics.median(values)
            for name, values in alternate_times(world, variants, repetitions).items()}


def mpitrain_in_place(arrays, prefix):
    def run():
        handles = [mt.allreduce_async(a, name=f"{prefix}.{i}", op=mt.Sum, output=a)
                   for i, a in enumerate(arrays)]
        for handle in handles:
            mt.synchronize(handle)
    return run


def mpitrain_out_of_place(arrays, prefix):
    """Reduce into new arrays, as most users call it. The results are held
    until the next call, as a user's loop holds them while it computes the
    next ones; run() returns the previous results for slowest() to drop."""
    held = []

    def run():
        handles = [mt.allreduce_async(a, name=f"{prefix}.{i}", op=mt.Sum)
                   for i, a in enumerate(arrays)]
        previous = list(held)
        held[:] = [mt.synchronize(handle) for handle in handles]
        return previous
    return run


def raw(world, buffer):
    return lambda: world.Allreduce(MPI.IN_PLACE, buffer)


def start_gloo(world):
    """torch.distributed with gloo on the same ranks, or None without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    torch.set_num_threads(1)
    port = None
    if world.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = world.bcast(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.rank, world_size=world.size)
    return lambda tensor: (lambda: dist.all_reduce(tensor))


def bus_bandwidth(nbytes, seconds, size):
    return 2 * (size - 1) / size * nbytes / seconds / 1e9


def idle_share(seconds):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before, start = usage.ru_utime + usage.ru_stime, time.monotonic()
    time.sleep(seconds)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime - before) / (time.monotonic() - start)


def resident_kib():
    """This process's resident set now (Linux), else its peak so far."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory_growth(world, steps):
    """(KiB the busiest rank's resident set grew from step steps/10 to the
    end, minor page faults per step over the same steps, busiest rank) of
    the geometric set reduced in place and out of place, step after step."""
    arrays = gradient_set("geometric")
    step_fns = [mpitrain_in_place(arrays, "memory.in"),
                mpitrain_out_of_place(arrays, "memory.out")]
    before = faults = None
    for step in range(steps):
        if step == steps // 10:
            before = resident_kib()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for fn in step_fns:
            fn()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return (world.allreduce(resident_kib() - before, op=MPI.MAX),
            world.allreduce(faults, op=MPI.MAX) / (steps - steps // 10))


class TargetRow(NamedTuple):
    case: str            # the tensors reduced
    call: str            # the call form
    baseline: str        # the raw call of the same bytes
    mpitrain: list       # seconds per repetition
    raw: list            # seconds per repetition, the same repetitions


CALL_FORMS = {"in place (output=a)": mpitrain_in_place,
              "out of place": mpitrain_out_of_place}


def target_sets(names):
    """(case, the arrays, the raw call's bytes) of each set named, one at a
    time: the large ones take half a GiB each."""
    for name in names:
        if name == "small":
            arrays = [np.ones(4096, np.float32) for _ in range(200)]
            yield "200 tensors x 16 KiB", arrays, "1 x 3.2 MB"
        else:
            arrays = gradient_set(name)
            nbytes = sum(a.nbytes for a in arrays)
            yield f"{name}: {describe(arrays)}", arrays, f"1 x {nbytes / MiB:.1f} MiB"


def targets(world, repetitions, names):
    """Both call forms of each set, each against one raw call of the same
    bytes, all taking turns within each repetition."""
    rows = []
    for case, arrays, baseline in target_sets(names):
        total = sum(a.size for a in arrays)
        variants = {"raw": raw(world, np.ones(total, np.float32))}
        for call, runner in CALL_FORMS.items():
            variants[call] = runner(arrays, f"{case.split(':')[0]}.{call.split()[0]}")
        times = alternate_times(world, variants, repetitions)
        rows += [TargetRow(case, call, baseline, times[call], times["raw"])
                 for call in CALL_FORMS]
        del variants, arrays
    return rows


def median_and_range(values, digits=2, unit=""):
    """'median (min-max)' of values."""
    return (f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def target_table(rows, repetitions):
    """Markdown table of the targets: times in ms and ratios to raw, each a
    median with its range over the repetitions."""
    lines = [f"Targets: medians of {repetitions} repetitions (min-max in brackets); "
             "mpitrain / raw is taken per repetition, against the raw call of the "
             "same repetition.", "",
             "| case | call | mpitrain, ms | raw mpi4py, ms | mpitrain / raw |",
             "|---|---|---|---|---|"]
    for row in rows:
        ratios = [ours / theirs for ours, theirs in zip(row.mpitrain, row.raw)]
        lines.append(
            f"| {row.case} | {row.call} "
            f"| {median_and_range([t * 1e3 for t in row.mpitrain])} "
            f"| {median_and_range([t * 1e3 for t in row.raw])}, {row.baseline} "
            f"| {median_and_range(ratios, unit='x')} |")
    return lines


def sweep(world, repetitions, gloo_for):
    rows = []
    for nbytes in SWEEP:
        count = nbytes // 4
        variants = {"raw mpi4py": raw(world, np.ones(count, np.float32)),
                    "mpitrain, 1 tensor": mpitrain_in_place(
                        [np.ones(count, np.float32)], f"one.{nbytes}"),
                    "mpitrain, model-like": mpitrain_in_place(
                        model_like(nbytes), f"set.{nbytes}")}
        if gloo_for is not None:
            import torch
            variants["gloo"] = gloo_for(torch.ones(count))
        reps = repetitions if nbytes <= 16 * MiB else max(3, repetitions // 3)
        rows.append((nbytes, alternate(world, variants, reps)))
    return rows


def health(idle, idle_seconds, memory, steps):
    growth, faults = memory
    lines = [f"Idle engine: {idle:.2%} of a core (busiest rank, {idle_seconds:g} s)."
             ] if idle_seconds > 0 else []
    return lines + [
        f"Resident memory over steps {steps // 10}-{steps} of the geometric set in "
        f"place and out of place: {growth:+d} KiB, {faults:.1f} page faults per "
        "step (busiest rank).",
        f"Load average (1 minute) at the end: {os.getloadavg()[0]:.2f} on "
        f"{os.cpu_count()} cores (other processes skew the figures)."]


def ranks_line(size):
    return (f"Ranks: {size} ({os.cpu_count()} cores"
            + (", oversubscribed" if size > (os.cpu_count() or 1) else "") + "); "
            "times of the slowest rank over alternated repetitions.")


def report(world, target_lines, sweep_rows, footer, out):
    size = world.size
    lines = [ranks_line(size), ""] + target_lines
    variants = list(sweep_rows[0][1])
    lines += ["", "Bus bandwidth, GB/s (median time in ms):", "",
              "| size | " + " | ".join(variants) + " |",
              "|---" * (len(variants) + 1) + "|"]
    for nbytes, result in sweep_rows:
        cells = [f"{bus_bandwidth(nbytes, t, size):.2f} ({t * 1e3:.2f})"
                 for t in result.values()]
        label = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [""] + footer
    text = "\n".join(lines)
    print(text)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "allreduce.md"), "w") as stream:
            stream.write("# Allreduce benchmark\n\nProduced by `.venv/bin/mpitrainrun -np "
                         f"{size} python benchmarks/allreduce.py --out {out}`.\n\n"
                         + text + "\n")
        plot(sweep_rows, size, os.path.join(out, "allreduce.png"))


def plot(sweep_rows, size, path):
    try:
        import matplotlib
    except ImportError:       # not among mpitrain's dependencies
        print(f"no {path}: matplotlib is not installed (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = [nbytes for nbytes, _ in sweep_rows]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for variant in sweep_rows[0][1]:
        axes.plot(sizes, [bus_bandwidth(n, r[variant], size) for n, r in sweep_rows],
                  marker="o", label=variant)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [f"{n // MiB}M" if n >= MiB else f"{n // KiB}K" for n in sizes])
    axes.set_xlabel("bytes per allreduce")
    axes.set_ylabel("bus bandwidth, GB/s")
    axes.set_title(f"allreduce on {size} ranks")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=21)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--memory-steps", type=int, default=1000)
    parser.add_argument("--sets", nargs="+", choices=SETS + ("small",),
                        default=list(SETS) + ["small"], help="the target sets")
    parser.add_argument("--no-sweep", action="store_true", help="only the targets")
    parser.add_argument("--json", help="file for the targets' times per repetition")
    parser.add_argument("--out", help="directory for allreduce.md and allreduce.png")
    args = parser.parse_args()
    mt.init()
    world = MPI.COMM_WORLD.Dup()
    mt.allreduce(np.ones(1), name="warm.up")
    # Before gloo starts: its threads would count as well.
    idle = world.allreduce(idle_share(args.idle_seconds), op=MPI.MAX)
    gloo_for = None if args.no_sweep else start_gloo(world)
    target_rows = targets(world, args.repetitions, args.sets)
    sweep_rows = [] if args.no_sweep else sweep(world, args.repetitions, gloo_for)
    memory = memory_growth(world, args.memory_steps)
    footer = health(idle, args.idle_seconds, memory, args.memory_steps)
    if world.rank == 0:
        if args.json:
            with open(args.json, "w") as stream:
                json.dump({"load": os.getloadavg()[0],
                           "rows": [row._asdict() for row in target_rows]}, stream)
        target_lines = target_table(target_rows, args.repetitions)
        if sweep_rows:
            report(world, target_lines, sweep_rows, footer, args.out)
        else:
            print("\n".join([ranks_line(world.size), ""] + target_lines + [""] + footer))


if __name__ == "__main__":
    main()
