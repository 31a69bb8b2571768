"""The training job benchmarks/elastic.py runs under mpitrainrun's elastic mode.

    elastic_job.py --params 100 --commit-every 1 --steps 12 --kill-at 8

An MLP of about --params million float32 parameters (square layers of
4096), Adam, a DistributedOptimizer and a TorchState. Rank 0 prints one
line of JSON per event, with time.time(): each step's duration and whether
it committed, how long commit() held the training thread and when the
commit's file was whole in this host's folder; in the run after a restart,
when the script started, when training resumed (the commit loaded) and
when the first step ended. In the first run the last rank SIGKILLs itself
at the start of step --kill-at.
"""

import argparse
import json
import os
import signal
import time

started = time.time()

import torch  # noqa: E402

import mpitrain.torch as hvd  # noqa: E402
from mpitrain.runtime import elastic_job  # noqa: E402

WIDTH = 4096

parser = argparse.ArgumentParser()
parser.add_argument("--params", type=float, default=100, help="millions of parameters")
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--commit-every", type=int, default=1)
parser.add_argument("--first-commit", type=int, default=4,
                    help="steps before the first commit (timed without commits)")
parser.add_argument("--kill-at", type=int)
args = parser.parse_args()


def say(event, **values):
    if hvd.rank() == 0:
        print("EVENT " + json.dumps({"event": event, "time": time.time(), **values}),
              flush=True)


torch.set_num_threads(max(1, os.cpu_count() // 2))
hvd.init()
layers = max(1, round(args.params * 1e6 / (WIDTH * WIDTH + WIDTH)))
model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-5),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)
parameters = sum(p.numel() for p in model.parameters())
say("started", at=started, restarts=state.restarts, parameters=parameters,
    ranks=hvd.size())
folder = elastic_job.this_job().host_directory()


def whole(commit):
    """When this host's file of ``commit`` is whole (renamed into place)."""
    path = os.path.join(folder, f"state0.commit{commit}")
    while not os.path.exists(path):
        time.sleep(0.01)
    return time.time()


@hvd.elastic.run
def train(state):
    say("resumed", step=state.step)
    while state.step < args.steps:
        if args.kill_at == state.step and state.restarts == 0 \
                and hvd.rank() == hvd.size() - 1:
            print(f"EVENT {json.dumps({'event': 'killed', 'time': time.time()})}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        begin = time.time()
        inputs = torch.randn(args.batch, WIDTH)
        state.optimizer.zero_grad()
        model(inputs).square().mean().backward()
        state.optimizer.step()
        state.step += 1
        stepped = time.time()
        commits = state.step >= args.first_commit and state.step % args.commit_every == 0
        if commits:
            state.commit()
        say("step", step=state.step, seconds=stepped - begin, committed=commits,
            commit_call=time.time() - stepped if commits else 0)
        if commits and state.restarts == 0 and state.step == args.first_commit:
            # The job's first commit (number 1): its write alone, no step beside it.
            say("written", step=state.step, seconds=whole(1) - stepped)


train(state)
say("finished", step=state.step)
