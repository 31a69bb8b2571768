"""GPU allreduce speed: mpitrain on CuPy arrays against raw MPI and raw NCCL.

Run on a CUDA machine, one rank per GPU (or several ranks sharing one):

    mpitrainrun -np 2 python benchmarks/allreduce_gpu.py
    MPITRAIN_GPU_OPERATIONS=mpi MPITRAIN_CUDA_AWARE=0 mpitrainrun -np 2 python benchmarks/allreduce_gpu.py

Same method as benchmarks/allreduce.py: slowest rank, medians of alternated
repetitions, and the range of those medians over --rounds rounds. mpitrain
runs as users call it: out of place (a new result array) and in place
(output=), for one tensor and for the same bytes in 64 tensors. Baselines in
the same processes: one mpi4py Allreduce of the device buffer where MPI is
CUDA-aware (else of a host copy, copies included) and one NCCL allReduce on
CuPy's stream, where NCCL can start (not with two ranks on one GPU), and
mpitrain on a numpy array of the same bytes, the host route that staging
feeds. The last lines give the figures of docs/gpu.md's speed table, against
their goals, and how many engine rounds a call of 64 tensors took (more than
one: the engine started before the 64 were all submitted, and paid a round's
fixed cost again).
"""

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from mpitrain.backends import arrays
from mpitrain.transport import selection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import KiB, MiB, alternate, bus_bandwidth, mpitrain_in_place  # noqa: E402

SIZES = (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)


def mpitrain_out_of_place(arrays_, prefix):
    def run():
        handles = [mt.allreduce_async(a, name=f"{prefix}.{i}", op=mt.Sum)
                   for i, a in enumerate(arrays_)]
        for handle in handles:
            mt.synchronize(handle)
    return run


def start_nccl(cupy, world):
    """(communicator, module), or (None, why) where NCCL cannot start on every rank."""
    try:
        from cupy.cuda import nccl
        unique_id = world.bcast(nccl.get_unique_id() if world.rank == 0 else None)
        communicator, problem = nccl.NcclCommunicator(world.size, unique_id, world.rank), ""
    except Exception as error:
        communicator, problem = None, f"{type(error).__name__}: {error}"
    problems = [p for p in world.allgather(problem) if p]
    return (communicator, nccl) if not problems else (None, problems[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    mt.init()
    cupy = arrays.cupy()
    if cupy is None:
        raise SystemExit(f"no CUDA device: {arrays.why_no_cupy()}")
    cupy.cuda.Device(mt.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    world = MPI.COMM_WORLD.Dup()
    engine = mt.api.basics.engine()
    communicator, nccl = start_nccl(cupy, world)

    def raw_mpi(buffer):
        if engine.cuda_aware:
            return lambda: (cupy.cuda.get_current_stream().synchronize(),
                            world.Allreduce(MPI.IN_PLACE, buffer))
        host = buffer.get()
        return lambda: (buffer.get(out=host), world.Allreduce(MPI.IN_PLACE, host),
                        buffer.set(host))

    def raw_nccl(buffer):
        stream = cupy.cuda.get_current_stream()
        return lambda: (communicator.allReduce(buffer.data.ptr, buffer.data.ptr,
                                               buffer.size, nccl.NCCL_FLOAT32,
                                               nccl.NCCL_SUM, stream.ptr),
                        stream.synchronize())

    rows, rounds_per_call = [], {}
    controller = engine.controllers[0]
    for nbytes in SIZES:
        count = nbytes // 4
        one = cupy.ones(count, cupy.float32)
        many = [cupy.ones(max(1, count // 64), cupy.float32) for _ in range(64)]
        variants = {
            "1 tensor, out of place": mpitrain_out_of_place([one], f"out.one.{nbytes}"),
            "1 tensor, in place": mpitrain_in_place([one], f"in.one.{nbytes}"),
            "64 tensors, out of place": mpitrain_out_of_place(many, f"out.many.{nbytes}"),
            "64 tensors, in place": mpitrain_in_place(many, f"in.many.{nbytes}"),
            "raw MPI" + ("" if engine.cuda_aware else " (host copies)"):
                raw_mpi(cupy.ones(count, cupy.float32)),
            # the host route alone: what staging can reach at best
            "1 host tensor, out of place": mpitrain_out_of_place(
                [np.ones(count, np.float32)], f"host.one.{nbytes}"),
        }
        if communicator is not None:
            variants["raw NCCL"] = raw_nccl(cupy.ones(count, cupy.float32))
        rounds = [alternate(world, variants, args.repetitions) for _ in range(args.rounds)]
        rows.append((nbytes, rounds))
        for name in ("64 tensors, in place", "1 tensor, in place"):
            world.Barrier()
            before = controller.rounds
            variants[name]()
            rounds_per_call[nbytes, name] = world.allreduce(controller.rounds - before,
                                                            op=MPI.MAX)
    if world.rank == 0:
        print(f"GPU allreduce, {world.size} ranks on "
              f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; mpitrain's "
              f"transport: {selection.describe(engine.device_plan, engine.cuda_aware)}")
        if communicator is None:
            print(f"raw NCCL: not measured, it could not start ({nccl})")
        print("bus GB/s (ms), range of the medians of " f"{args.rounds} rounds:")
        print("size | " + " | ".join(rows[0][1][0]))
        for nbytes, rounds in rows:
            cells = []
            for name in rounds[0]:
                seconds = sorted(r[name] for r in rounds)
                cells.append(f"{bus_bandwidth(nbytes, seconds[-1], world.size):.1f}-"
                             f"{bus_bandwidth(nbytes, seconds[0], world.size):.1f} "
                             f"({seconds[0] * 1e3:.2f}-{seconds[-1] * 1e3:.2f})")
            print(f"{nbytes // KiB} KiB | " + " | ".join(cells))
        print("64 tensors / 1 tensor of the same bytes (goal: at most 2), and the "
              "engine rounds of one call (64 tensors; 1 tensor):")
        for nbytes, rounds in rows:
            cells = []
            for how in ("in place", "out of place"):
                ratio = [r[f"64 tensors, {how}"] / r[f"1 tensor, {how}"] for r in rounds]
                cells.append(f"{how} {min(ratio):.2f}-{max(ratio):.2f}")
            calls = [rounds_per_call[nbytes, f"{many} in place"]
                     for many in ("64 tensors,", "1 tensor,")]
            print(f"  {nbytes // KiB} KiB: " + ", ".join(cells)
                  + f"; rounds {calls[0]}; {calls[1]}")
        print_speed_table(rows, world.size, engine)


def print_speed_table(rows, size, engine):
    """The rows of docs/gpu.md's speed table that this run measures."""
    plan = engine.device_plan
    transport = "NCCL" if plan.nccl else "CUDA-aware MPI" if plan.cuda_aware else "staged"
    small = [(nbytes, rounds) for nbytes, rounds in rows if nbytes <= 1 * MiB]
    ratios = [r[f"64 tensors, {how}"] / r[f"1 tensor, {how}"]
              for _, rounds in small for r in rounds for how in ("in place", "out of place")]
    largest, rounds = rows[-1]
    bandwidths = [bus_bandwidth(largest, r["1 tensor, out of place"], size) for r in rounds]
    print(f"speed table, {size} ranks, {transport}:")
    print(f"  64 tensors / 1 tensor of the same bytes, "
          f"{small[0][0] // KiB} KiB-{small[-1][0] // KiB} KiB: "
          f"{min(ratios):.2f}-{max(ratios):.2f}x (goal: at most 2x)")
    host = [bus_bandwidth(largest, r["1 host tensor, out of place"], size) for r in rounds]
    print(f"  {largest // MiB} MiB bus bandwidth, 1 tensor: {min(bandwidths):.1f}-"
          f"{max(bandwidths):.1f} GB/s (goal: at least 6 GB/s, staged on 2 ranks); "
          f"the same in host memory: {min(host):.1f}-{max(host):.1f} GB/s")


if __name__ == "__main__":
    main()
