"""Trains for argv[1] steps of 8 allreduces under new names each step (so the
timeline grows fast), checks every result, and says so."""

import sys

import numpy as np

import mpitrain as mt

mt.init()
for step in range(int(sys.argv[1])):
    handles = [mt.allreduce_async(np.full(100, mt.rank() + 1.0), name=f"s{step}.t{i}",
                                  op=mt.Sum) for i in range(8)]
    for handle in handles:
        assert (mt.synchronize(handle) == mt.size() * (mt.size() + 1) / 2).all()
print(f"rank {mt.rank()} trained", flush=True)
mt.shutdown()
