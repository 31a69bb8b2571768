"""GPU allreduce speed: mpitrain on CuPy arrays against raw MPI and raw NCCL.

Run on a CUDA machine, one rank per GPU (or several ranks sharing one):

    mpitrainrun -np 2 python benchmarks/allreduce_gpu.py
    MPITRAIN_GPU_OPERATIONS=nccl mpitrainrun -np 2 python benchmarks/allreduce_gpu.py

Same method as benchmarks/allreduce.py: slowest rank, medians of alternated
repetitions. Baselines: one mpi4py Allreduce of a device buffer (only when MPI
is CUDA-aware, else of a host copy) and one NCCL allReduce on CuPy's stream.
Not run on the development machines, which have no GPU.
"""

import argparse
import os
import sys

from mpi4py import MPI

import mpitrain as mt
from mpitrain import arrays

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import (  # noqa: E402
    KiB, MiB, alternate, bus_bandwidth, mpitrain_in_place)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=21)
    args = parser.parse_args()
    mt.init()
    cupy = arrays.cupy()
    if cupy is None:
        raise SystemExit("no CUDA device: this benchmark needs CuPy and a GPU")
    cupy.cuda.Device(mt.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    world = MPI.COMM_WORLD.Dup()
    nccl = cupy.cuda.nccl
    unique_id = world.bcast(nccl.get_unique_id() if world.rank == 0 else None)
    communicator = nccl.NcclCommunicator(world.size, unique_id, world.rank)
    cuda_aware = mt.basics.engine().cuda_aware

    def raw_mpi(buffer):
        host = buffer.get()
        if cuda_aware:
            return lambda: (cupy.cuda.get_current_stream().synchronize(),
                            world.Allreduce(MPI.IN_PLACE, buffer))
        return lambda: (buffer.get(out=host), world.Allreduce(MPI.IN_PLACE, host),
                        buffer.set(host))

    def raw_nccl(buffer):
        stream = cupy.cuda.get_current_stream()
        return lambda: (communicator.allReduce(buffer.data.ptr, buffer.data.ptr,
                                               buffer.size, nccl.NCCL_FLOAT32,
                                               nccl.NCCL_SUM, stream.ptr),
                        stream.synchronize())

    rows = []
    for nbytes in (64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB):
        count = nbytes // 4
        one = cupy.ones(count, cupy.float32)
        many = [cupy.ones(max(1, count // 64), cupy.float32) for _ in range(64)]
        result = alternate(world, {
            "mpitrain, 1 tensor": mpitrain_in_place([one], f"one.{nbytes}"),
            "mpitrain, 64 tensors": mpitrain_in_place(many, f"many.{nbytes}"),
            "raw MPI" + ("" if cuda_aware else " (host copy)"):
                raw_mpi(cupy.ones(count, cupy.float32)),
            "raw NCCL": raw_nccl(cupy.ones(count, cupy.float32)),
        }, args.repetitions)
        rows.append((nbytes, result))
    if world.rank == 0:
        print(f"GPU allreduce, {world.size} ranks, CUDA-aware MPI: {cuda_aware}, "
              f"MPITRAIN_GPU_OPERATIONS={os.environ.get('MPITRAIN_GPU_OPERATIONS', 'mpi')}")
        print("size | " + " | ".join(rows[0][1]) + "   (bus GB/s, ms)")
        for nbytes, result in rows:
            cells = [f"{bus_bandwidth(nbytes, t, world.size):.1f} ({t * 1e3:.2f})"
                     for t in result.values()]
            print(f"{nbytes // KiB} KiB | " + " | ".join(cells))


if __name__ == "__main__":
    main()
