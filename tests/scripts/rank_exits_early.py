"""Rank 1 leaves the job early (without calling shutdown) while rank 0 waits."""

import sys
import time

import numpy as np

import mpitrain as mt

mt.init()
if mt.rank() == 1:
    time.sleep(0.3)
    sys.exit(0)                    # mpitrain shuts down at exit on its own
started = time.monotonic()
try:
    mt.allreduce(np.ones(3), name="never.answered")
except mt.ShutdownError as error:
    print(f"rank 0 got ShutdownError after {time.monotonic() - started:.1f} s: {error}")
