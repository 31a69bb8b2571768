"""Writes a timeline and never stops; the test kills it mid-run."""

import numpy as np

import mpitrain as mt

mt.init()
step = 0
while True:
    handles = [mt.allreduce_async(np.ones(1000), name=f"t{i}") for i in range(8)]
    for handle in handles:
        mt.synchronize(handle)
    step += 1
    if step == 20:
        print("running", flush=True)
