"""A Horovod elastic training script (TorchState, ElasticSampler, commit),
with ways to hurt it, for tests/test_elastic_hosts.py.

    elastic_training.py OUT [--kill-at E:B] [--cut-link-at E:B INTERFACE]
                            [--stall-write-at E:B] [--add-host-at E:B HOSTS_FILE LINE]
                            [--sleep S] [--start-from FILE]

Rank 0 prints the time of its first step after a restart; the rank killed
prints the time it was killed. Epoch E's batch B is the B-th batch the job trains in epoch E (counted
from 1, across restarts). Rank 0 saves the state it is about to commit to
OUT/commit-r<restarts>-e<E>-b<B>.pt, and the final model to OUT/final.pt.
In the job's first run only: --kill-at SIGKILLs the last rank after that
batch's backward pass; --cut-link-at has the last rank take its host's
network INTERFACE down there instead (a host cut off: nothing it had open
is closed, and it goes on waiting); --stall-write-at makes that commit's write to the
hosts' files hang (the state holds a value that takes a minute to pickle),
and the last rank is killed at the next batch; --add-host-at appends LINE
to the discovery script's HOSTS_FILE. --start-from loads a saved commit
first: a reference run, under plain mpirun.
"""

import argparse
import os
import signal
import subprocess
import time

import torch

import mpitrain.torch as hvd

EPOCHS, BATCH, SAMPLES = 3, 4, 72


def point(text):
    epoch, batch = text.split(":")
    return int(epoch), int(batch)


parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--kill-at", type=point)
parser.add_argument("--cut-link-at", nargs=2)
parser.add_argument("--stall-write-at", type=point)
parser.add_argument("--add-host-at", nargs=3)
parser.add_argument("--sleep", type=float, default=0)
parser.add_argument("--start-from")
args = parser.parse_args()


class SlowToPickle:
    """Pickling it takes a minute once ``stalled`` is set: a write of the
    state that hangs half done. Copying it in memory is instant."""
    stalled = False

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        if SlowToPickle.stalled:
            time.sleep(60)
        return SlowToPickle, ()


torch.set_num_threads(1)
hvd.init()
torch.manual_seed(100 + hvd.rank())         # the first sync gives every rank rank 0's
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
    named_parameters=model.named_parameters())
data = torch.Generator().manual_seed(7)
dataset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=data),
                                         torch.randint(3, (SAMPLES,), generator=data))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
epoch = batch = 0
if args.start_from:
    saved = torch.load(args.start_from, weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    sampler.load_state_dict(saved["sampler"])
    epoch, batch = saved["epoch"], saved["batch"]
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=epoch, batch=batch,
                               slow=SlowToPickle())
first_run = state.restarts == 0 and not args.start_from
first_step_after_restart = state.restarts > 0


def save_commit(state):
    if hvd.rank() == 0:
        torch.save({"model": state.model.state_dict(),
                    "optimizer": state.optimizer.state_dict(),
                    "sampler": state.sampler.state_dict(),
                    "epoch": state.epoch, "batch": state.batch},
                   os.path.join(args.out, f"commit-r{state.restarts}-e{state.epoch}"
                                          f"-b{state.batch}.pt"))


@hvd.elastic.run
def train(state):
    global first_step_after_restart
    while state.epoch < EPOCHS:
        for index, (inputs, labels) in enumerate(loader):
            state.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(state.model(inputs), labels).backward()
            here = (state.epoch, state.batch + 1)
            killed = args.kill_at or (args.stall_write_at and
                                      (args.stall_write_at[0], args.stall_write_at[1] + 1))
            if first_run and here == killed and hvd.rank() == hvd.size() - 1:
                print(f"rank {hvd.rank()} killed at epoch {here[0]} batch {here[1]}, "
                      f"time {time.time()}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if first_run and args.cut_link_at and here == point(args.cut_link_at[0]) \
                    and hvd.rank() == hvd.size() - 1:
                print(f"rank {hvd.rank()} cuts its host off at epoch {here[0]} batch "
                      f"{here[1]}", flush=True)
                time.sleep(1)                   # for the line to reach mpirun first
                subprocess.run(["ip", "link", "set", args.cut_link_at[1], "down"], check=True)
            state.optimizer.step()
            if first_step_after_restart and hvd.rank() == 0:
                print(f"first step after the restart done, time {time.time()}", flush=True)
            first_step_after_restart = False
            state.batch += 1
            state.sampler.record_batch(index, BATCH)
            if first_run and args.add_host_at and here == point(args.add_host_at[0]) \
                    and hvd.rank() == 0:
                with open(args.add_host_at[1], "a") as hosts:
                    hosts.write(args.add_host_at[2] + "\n")
            time.sleep(args.sleep)
            if state.batch % 2 == 0:
                SlowToPickle.stalled = first_run and here == args.stall_write_at
                save_commit(state)
                state.commit()
        state.epoch, state.batch = state.epoch + 1, 0
        state.sampler.set_epoch(state.epoch)
        save_commit(state)
        state.commit()


train(state)
if hvd.rank() == 0:
    torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    print(f"finished with {hvd.size()} ranks after {state.restarts} restarts", flush=True)
