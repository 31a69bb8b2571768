"""The ranks' side of benchmarks/hierarchical_allreduce.py: times one float32
tensor of each size through mpitrain.allreduce (in place, on whatever route
the job's settings chose) and through MPI.COMM_WORLD.Allreduce, taking turns
within each repetition. Rank 0 prints one line, RESULT {json}: the route
every rank reported and the seconds of every repetition on the slowest rank.

    mpirun ... python benchmarks/hierarchical_allreduce_job.py SIZE_MIB... [--repetitions N]
"""

import argparse
import json
import os
import sys

import numpy as np

# As mpitrain sets it: Open MPI's blocking calls yield the core while waiting,
# which matters with more ranks than cores.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
from mpi4py import MPI  # noqa: E402  (after the setting above)

import mpitrain as mt  # noqa: E402
from mpitrain.api.basics import engine  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import MiB, alternate_times, mpitrain_in_place, raw  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes_mib", type=int, nargs="+")
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args()
    mt.init()
    world = MPI.COMM_WORLD.Dup()
    routes = mt.allgather_object(engine().host_route.description)
    results = {}
    for size in args.sizes_mib:
        count = size * MiB // 4
        times = alternate_times(world, {
            "mpitrain": mpitrain_in_place([np.ones(count, np.float32)], f"bench.{size}"),
            "raw": raw(world, np.ones(count, np.float32))}, args.repetitions)
        results[size] = times
    if world.rank == 0:
        print("RESULT " + json.dumps({"routes": routes, "times": results}), flush=True)


if __name__ == "__main__":
    main()
