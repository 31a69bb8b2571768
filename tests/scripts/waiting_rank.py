"""A rank that sums once, writes its pid to RUN_DIR/pid.<rank>, waits until
RUN_DIR/stop appears (two minutes at most) and sums again; tests/test_launcher.py.

    waiting_rank.py RUN_DIR
"""

import os
import sys
import time

import numpy as np

import mpitrain as mt

run_dir = sys.argv[1]
mt.init()
before = mt.allreduce(np.ones(4), name="before", op=mt.Sum)
pid_file = os.path.join(run_dir, f"pid.{mt.rank()}")
with open(pid_file + ".part", "w") as stream:
    stream.write(str(os.getpid()))
os.rename(pid_file + ".part", pid_file)
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(run_dir, "stop")) and time.monotonic() < deadline:
    time.sleep(0.1)
after = mt.allreduce(np.ones(4), name="after", op=mt.Sum)
print(f"rank {mt.rank()} sums {before[0]:g} {after[0]:g}", flush=True)
