"""Horovod's elastic recipe in 20 steps, a commit after every step, in which
the last rank SIGKILLs itself at step 5; for tests/test_elastic_one_host.py.

    elastic_steps.py [first-run | every-run | never]

It dies in the job's first run only (the default), in every run, or never.
At the end every rank prints "rank R: 20 steps, restarts N, parameters
DIGEST", DIGEST the SHA-256 of its parameters' bytes.
"""

import hashlib
import os
import signal
import sys

import torch

import mpitrain.torch as hvd

STEPS, KILLED_AT = 20, 5
when = sys.argv[1] if len(sys.argv) > 1 else "first-run"

torch.set_num_threads(1)
hvd.init()
torch.manual_seed(100 + hvd.rank())         # the first sync gives every rank rank 0's
model = torch.nn.Linear(8, 4)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, step=0)
dies = hvd.rank() == hvd.size() - 1 and (
    when == "every-run" or (when == "first-run" and state.restarts == 0))


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        data = torch.Generator().manual_seed(state.step * hvd.size() + hvd.rank())
        inputs, targets = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        state.optimizer.zero_grad()
        torch.nn.functional.mse_loss(state.model(inputs), targets).backward()
        if dies and state.step == KILLED_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        state.optimizer.step()
        state.step += 1
        state.commit()


train(state)
digest = hashlib.sha256(b"".join(parameter.detach().numpy().tobytes()
                                 for parameter in model.parameters())).hexdigest()
print(f"rank {hvd.rank()}: {state.step} steps, restarts {state.restarts}, "
      f"parameters {digest}", flush=True)
