"""Every rank prints a line and, once all have, fails with a traceback three
calls deep; tests/test_launcher.py."""

import mpitrain as mt


def load_batch(step):
    raise RuntimeError(f"rank {mt.rank()}: the batch of step {step} is corrupt")


def train():
    for step in range(3):
        load_batch(step)


mt.init()
print(f"rank {mt.rank()} starts training", flush=True)
mt.barrier()
train()
