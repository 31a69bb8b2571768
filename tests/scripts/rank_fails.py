"""A training loop in which the last rank fails at step 5; tests/test_faults.py.

    rank_fails.py HOW WHILE RUN_DIR

HOW: raise (an unhandled exception), thread (one in a data-loading thread,
while the main thread waits for its batch), sigkill, freeze (SIGSTOP),
stall (stops submitting: sleeps for an hour), freeze-in-transfer (SIGSTOP
while its engine is inside the MPI call of a large allreduce), engine-fails
(its engine cannot allocate that allreduce's result and fails, while the
others wait for it inside MPI), split-route (its alltoall takes another
route than the others' and enters another MPI call than they do, 1.5 s
after them).
WHILE: what the other ranks do meanwhile: allreduce (wait for the failed
rank's tensor), compute (an hour of work that calls no MPI), or elastic
(wait for its tensor, every rank training inside mpitrain.api.elastic.run).
Every rank writes its pid to RUN_DIR/pid.<rank>; the failing rank writes the
wall-clock time of its failure to RUN_DIR/failed_at.
"""

import os
import queue
import signal
import sys
import threading
import time

import numpy as np

import mpitrain as mt
from mpitrain.api import elastic
from mpitrain.transport import channel

BIG = 64 << 20         # floats in the large allreduce of step 5 (256 MiB)

how, meanwhile, run_dir = sys.argv[1:4]
mt.init()
rank, size = mt.rank(), mt.size()
with open(os.path.join(run_dir, f"pid.{rank}"), "w") as stream:
    stream.write(str(os.getpid()))


def fail():
    with open(os.path.join(run_dir, "failed_at"), "w") as stream:
        stream.write(repr(time.time()))
    if how == "raise":
        raise RuntimeError("the batch of step 5 is corrupt (raised on purpose)")
    if how == "thread":
        batches = queue.Queue()

        def load_batch():
            raise OSError("the data file vanished (raised on purpose)")

        threading.Thread(target=load_batch, name="loader").start()
        batches.get()                    # waits for a batch that never comes
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    if how == "stall":
        time.sleep(3600)


def freeze_inside_the_transfer():
    watch = mt.api.basics.engine().watch
    while "'big'" not in str(watch._inside):
        time.sleep(0.001)
    with open(os.path.join(run_dir, "failed_at"), "w") as stream:
        stream.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


def take_another_route_late():
    """This rank's alltoall goes rank to rank (its count limit is lowered),
    while the others' goes through MPI's Alltoallv; it enters its MPI call
    1.5 s after them, as after copying the 2.2 GB it sends itself in the
    case of issue 28."""
    channel.COUNT_LIMIT = 0
    exchange = channel.Channel.exchange

    def late_exchange(self, outgoing, incoming):
        time.sleep(1.5)
        yield from exchange(self, outgoing, incoming)

    channel.Channel.exchange = late_exchange


def leave_no_room_for_the_result():
    import resource
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status
                    if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + (128 << 20), resource.RLIM_INFINITY))


def train(state):
    big = np.ones(BIG, np.float32) if how in ("freeze-in-transfer", "engine-fails") else None
    while state.step < 10:
        if state.step == 5 and big is not None:
            if rank == size - 1 and how == "freeze-in-transfer":
                threading.Thread(target=freeze_inside_the_transfer).start()
            if rank == size - 1 and how == "engine-fails":
                with open(os.path.join(run_dir, "failed_at"), "w") as stream:
                    stream.write(repr(time.time()))
                leave_no_room_for_the_result()
            mt.allreduce(big, name="big")
        elif state.step == 5 and how == "split-route":
            if rank == size - 1:
                with open(os.path.join(run_dir, "failed_at"), "w") as stream:
                    stream.write(repr(time.time()))
                take_another_route_late()
            mt.alltoall(np.full(size, rank, np.float32), name="a2a")
        elif state.step == 5 and rank == size - 1:
            fail()
        if state.step == 5 and rank != size - 1 and meanwhile == "compute":
            time.sleep(3600)
        state.weights -= 0.1 * mt.allreduce(np.full(1000, rank, np.float32),
                                            name="gradient")
        state.step += 1
        state.commit()


state = elastic.State(step=0, weights=np.zeros(1000, np.float32))
(elastic.run(train) if meanwhile == "elastic" else train)(state)
print(f"rank {rank} finished", flush=True)
