"""Every rank raises at the same moment; tests/test_launcher.py checks that
each rank's traceback comes out in one piece.

    ranks_fail_together.py [FRAMES]

FRAMES (60 by default) make a traceback of some 7 KiB, longer than the 4 KiB
pieces Open MPI forwards a rank's output in; 4 make one of 1 KiB. The frames
alternate between two functions so that Python prints each of them instead
of "[Previous line repeated N more times]"."""

import sys

import numpy as np

import mpitrain as mt

mt.init()


def load_batch(depth):
    if depth == 0:
        raise RuntimeError(f"rank {mt.rank()}'s batch is corrupt (raised on purpose)")
    parse_batch(depth - 1)


def parse_batch(depth):
    load_batch(depth - 1)


mt.allreduce(np.ones(1), name="together")       # the ranks leave it at once
load_batch(int(sys.argv[1]) if len(sys.argv) > 1 else 60)
