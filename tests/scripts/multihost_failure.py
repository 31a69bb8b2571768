"""Ranks allreduce step after step until, at step 20, rank 3 dies: killed by
SIGKILL (`kill`) or by an exception (`raise`); the job must end on every
host. tests/test_multihost.py."""

import itertools
import os
import signal
import sys

import numpy as np

import mpitrain as mt

how = sys.argv[1]
mt.init()
for step in itertools.count():
    if step == 20 and mt.rank() == 3:
        print(f"rank 3 dies by {how} at step {step}", flush=True)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"rank 3 fails at step {step}")
    mt.allreduce(np.full(1000, float(step), np.float32), name="step")
