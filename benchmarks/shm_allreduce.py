"""Shared-memory allreduce (mpitrain.transport.shm) against raw MPI Allreduce.

Run on 2 ranks of one node:

    mpirun -np 2 python benchmarks/shm_allreduce.py [--repetitions 11]

Every figure is the time of the slowest rank; in each repetition the variants
take turns, so all see the same machine state, and ratios are taken per
repetition, against that repetition's raw call. Figures are medians with
their range (min-max) over the repetitions. Variants, on float32:
  raw       comm.Allreduce(MPI.IN_PLACE, buffer, MPI.SUM);
  in place  the shared-memory allreduce of a buffer holding the input;
  fill      the same, its input copied by fill from a separate array into the
            segment (what an out-of-place user call costs).
Sections:
  sizes   the three variants at 1, 16, 64 and 256 MiB (--sizes-kib), at --chunk-bytes;
  chunks  in place and fill at 64 MiB for chunk sizes from 256 KiB to 8 MiB.
"""

import argparse
import os
import statistics

import numpy as np

# As mpitrain sets it: Open MPI's blocking calls yield the core while waiting.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
from mpi4py import MPI  # noqa: E402  (after the setting above)

from allreduce import alternate_times, raw  # noqa: E402
from mpitrain.ops import ReduceOp  # noqa: E402
from mpitrain.transport.chunk_io import ChunkIO  # noqa: E402
from mpitrain.transport.shm import DEFAULT_CHUNK_BYTES, SharedMemoryAllreduce  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
CHUNKS = [256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB]


def shared_in_place(reducer, buffer):
    return lambda: _run(reducer.allreduce(buffer, ReduceOp.SUM))


class _CopiedIn(ChunkIO):
    fills = True

    def __init__(self, source):
        self.source = source

    def fill(self, start, stop, destination):
        np.copyto(destination, self.source[start:stop])


def shared_with_fill(reducer, source, result):
    return lambda: _run(reducer.allreduce(result, ReduceOp.SUM, _CopiedIn(source)))


def _run(collective):
    for _ in collective:        # blocking: nothing is yielded
        pass


def check(comm, reducer, count):
    """The allreduce of ones gives comm.size everywhere, both ways."""
    buffer = np.ones(count, np.float32)
    _run(reducer.allreduce(buffer, ReduceOp.SUM))
    result = np.empty_like(buffer)
    shared_with_fill(reducer, np.ones_like(buffer), result)()
    if not (buffer == comm.size).all() or not (result == comm.size).all():
        raise SystemExit(f"rank {comm.rank}: wrong result at {count * 4} bytes")


def median_and_range(values, digits=2, unit=""):
    """'median (min-max)' of values."""
    return (f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def ratios(times, name):
    return [ours / theirs for ours, theirs in zip(times[name], times["raw"])]


def label(nbytes):
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def sizes_section(comm, chunk_bytes, repetitions, sizes):
    reducer = SharedMemoryAllreduce(comm, chunk_bytes)
    lines = [f"Sizes (chunk_bytes = {label(chunk_bytes)}): ms, and ratios to raw "
             "taken per repetition.", "",
             "| size | raw, ms | in place, ms | fill, ms | in place / raw | fill / raw |",
             "|---|---|---|---|---|---|"]
    for nbytes in sizes:
        count = nbytes // 4
        check(comm, reducer, count)
        times = alternate_times(comm, {
            "raw": raw(comm, np.ones(count, np.float32)),
            "in place": shared_in_place(reducer, np.ones(count, np.float32)),
            "fill": shared_with_fill(reducer, np.ones(count, np.float32),
                                     np.empty(count, np.float32))}, repetitions)
        cells = [median_and_range([t * 1e3 for t in times[name]], 1)
                 for name in ("raw", "in place", "fill")]
        cells += [median_and_range(ratios(times, name), unit="x")
                  for name in ("in place", "fill")]
        lines.append(f"| {label(nbytes)} | " + " | ".join(cells) + " |")
    reducer.close()
    return lines


def chunks_section(comm, repetitions):
    count = 64 * MiB // 4
    source, result = np.ones(count, np.float32), np.empty(count, np.float32)
    buffer = np.ones(count, np.float32)
    reducers = {chunk: SharedMemoryAllreduce(comm, chunk) for chunk in CHUNKS}
    variants = {"raw": raw(comm, np.ones(count, np.float32))}
    for chunk, reducer in reducers.items():
        variants[f"in place {chunk}"] = shared_in_place(reducer, buffer)
        variants[f"fill {chunk}"] = shared_with_fill(reducer, source, result)
    times = alternate_times(comm, variants, repetitions)
    lines = ["64 MiB by chunk_bytes: ratios to raw "
             f"(raw: {median_and_range([t * 1e3 for t in times['raw']], 1)} ms).", "",
             "| chunk_bytes | in place / raw | fill / raw |", "|---|---|---|"]
    for chunk, reducer in reducers.items():
        lines.append(f"| {label(chunk)} | "
                     f"{median_and_range(ratios(times, f'in place {chunk}'), unit='x')} | "
                     f"{median_and_range(ratios(times, f'fill {chunk}'), unit='x')} |")
        reducer.close()
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=11)
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--no-chunks", action="store_true", help="only the sizes")
    parser.add_argument("--sizes-kib", type=int, nargs="+",
                        default=[size // KiB for size in SIZES],
                        help="buffer sizes in KiB (default: 1, 16, 64 and 256 MiB)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    lines = sizes_section(comm, args.chunk_bytes, args.repetitions,
                          [size * KiB for size in args.sizes_kib])
    if not args.no_chunks:
        lines += [""] + chunks_section(comm, args.repetitions)
    if comm.rank == 0:
        print(f"Ranks: {comm.size} ({os.cpu_count()} cores); times of the slowest "
              "rank over alternated repetitions, median (min-max).\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
