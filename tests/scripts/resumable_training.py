"""Training that checkpoints every 10 steps and resumes where it left off.

    resumable_training.py CHECKPOINT STEPS RESULT [DIE_AT_STEP]

Every rank starts from its own random weights (load_checkpoint gives them
the root's, or the checkpoint's). With DIE_AT_STEP the last rank kills
itself with SIGKILL during that step, after its backward pass. At the end
rank 0 saves the model's final state_dict to RESULT.
"""

import os
import signal
import sys

import torch

import mpitrain.torch as hvd

torch.set_num_threads(1)
path, steps, result = sys.argv[1], int(sys.argv[2]), sys.argv[3]
die_at = int(sys.argv[4]) if len(sys.argv) > 4 else None

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(100 + rank)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 3))
optimizer = hvd.DistributedOptimizer(
    torch.optim.Adam(model.parameters(), lr=0.01),
    named_parameters=model.named_parameters())
resumed = hvd.load_checkpoint(path, model, optimizer)
start = resumed["step"] if resumed else 0
print(f"rank {rank} starts at step {start}", flush=True)

for step in range(start, steps):
    batch = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(16, 8, generator=batch)
    labels = torch.randint(3, (16,), generator=batch)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    if step == die_at and rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    optimizer.step()
    if (step + 1) % 10 == 0:
        hvd.save_checkpoint(path, model, optimizer, step=step + 1)

if rank == 0:
    torch.save(model.state_dict(), result)
