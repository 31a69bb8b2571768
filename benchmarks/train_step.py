"""One training step of an 18.9M-parameter MLP: mpitrain against PyTorch DDP.

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/train_step.py

The model is 1024 -> 5 x 2048 -> 10 (ReLU), trained with SGD and momentum on
a synthetic batch of 64 per rank, one thread per rank. Three modes share the
same processes and run in turn, step after step:
  none:      the plain optimizer, no communication (the floor);
  ddp:       torch DistributedDataParallel over gloo;
  mpitrain:  mpitrain.torch.DistributedOptimizer.
A step is zero_grad, forward, backward and optimizer step, timed on the
slowest rank; the figures are medians. The ddp and mpitrain models start
equal and see the same batches, so they must end with the same parameters.
A fourth measurement, taken in turn with the others, averages the same
gradients with mpitrain alone (no compute), so the share of communication
hidden behind backward is 1 - (mpitrain - none) / (allreduce alone).
"""

import argparse
import copy
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel

import mpitrain as mt
import mpitrain.torch as hvd

BATCH, INPUTS, WIDTH, DEPTH, CLASSES = 64, 1024, 2048, 5, 10


def build_model():
    layers, width = [], INPUTS
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(width, WIDTH), torch.nn.ReLU()]
        width = WIDTH
    layers.append(torch.nn.Linear(width, CLASSES))
    return torch.nn.Sequential(*layers)


def start_gloo(world):
    """torch.distributed over gloo on the loopback, at a port rank 0 found free."""
    port = None
    if world.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = world.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", init_method="env://", rank=world.rank,
                            world_size=world.size)


def batch(step, rank):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(BATCH, INPUTS, generator=generator),
            torch.randint(CLASSES, (BATCH,), generator=generator))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def make_modes(base):
    """none, ddp, mpitrain (overlap chosen for this machine), and mpitrain with
    the other choice, so the figures show what the choice is worth."""
    models = {name: copy.deepcopy(base) for name in ("none", "ddp", "mpitrain", "other")}
    chosen = hvd.DistributedOptimizer(
        sgd(models["mpitrain"]), named_parameters=models["mpitrain"].named_parameters())
    other = f"mpitrain, overlap={not chosen._overlap}"
    optimizers = {
        "none": sgd(models["none"]),
        "ddp": sgd(models["ddp"]),
        "mpitrain": chosen,
        other: hvd.DistributedOptimizer(
            sgd(models["other"]), overlap=not chosen._overlap,
            named_parameters=[(f"other.{n}", p)
                              for n, p in models["other"].named_parameters()]),
    }
    forward = {"none": models["none"], "ddp": DistributedDataParallel(models["ddp"]),
               "mpitrain": models["mpitrain"], other: models["other"]}
    return models, forward, optimizers


def train_step(forward, optimizer, inputs, labels):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(forward(inputs), labels)
    loss.backward()
    optimizer.step()


def allreduce_alone(model):
    """Average the model's gradients in place, as DistributedOptimizer does."""
    gradients = [p.grad.numpy() for p in model.parameters()]

    def run():
        handles = [mt.allreduce_async(g, name=f"alone.{i}", output=g)
                   for i, g in enumerate(gradients)]
        for handle in handles:
            mt.synchronize(handle)
    return run


def max_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    hvd.init()
    world = MPI.COMM_WORLD.Dup()
    start_gloo(world)
    torch.manual_seed(0)
    base = build_model()
    models, forward, optimizers = make_modes(base)
    modes = list(forward)
    times = {name: [] for name in modes + ["allreduce alone"]}
    communicate = None
    for step in range(args.warmup + args.steps):
        inputs, labels = batch(step, world.rank)
        order = modes[step % len(modes):] + modes[:step % len(modes)]
        for name in order:
            world.Barrier()
            start = time.perf_counter()
            train_step(forward[name], optimizers[name], inputs, labels)
            elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if step >= args.warmup:
                times[name].append(elapsed)
        communicate = communicate or allreduce_alone(models["none"])
        world.Barrier()
        start = time.perf_counter()
        communicate()
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if step >= args.warmup:
            times["allreduce alone"].append(elapsed)
    difference = world.allreduce(max_difference(models["ddp"], models["mpitrain"]),
                                 op=MPI.MAX)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    if world.rank == 0:
        count = sum(p.numel() for p in base.parameters())
        print(f"train step of a {count / 1e6:.1f}M-parameter MLP, batch {BATCH} per "
              f"rank, {world.size} ranks, 1 thread each; medians of {args.steps} "
              "alternated steps (slowest rank)")
        overlap = optimizers["mpitrain"]._overlap
        for name in modes:
            label = f"mpitrain (overlap={overlap})" if name == "mpitrain" else name
            print(f"  {label:<25} {medians[name]:7.1f} ms")
        alone = medians["allreduce alone"]
        print(f"  averaging the gradients alone takes {alone:.1f} ms; hidden behind "
              "backward:")
        for name in modes[2:]:
            added = medians[name] - medians["none"]
            hidden = min(1.0, max(0.0, 1 - added / alone))
            print(f"    {name}: the step adds {added:.1f} ms, {hidden:.0%} of it hidden")
        print(f"  mpitrain / ddp  = {medians['mpitrain'] / medians['ddp']:.2f}")
        print(f"  mpitrain / none = {medians['mpitrain'] / medians['none']:.2f}   "
              f"ddp / none = {medians['ddp'] / medians['none']:.2f}")
        print(f"  parameters after {args.warmup + args.steps} steps, mpitrain vs ddp: "
              f"max |difference| = {difference:.3g}")
        print(f"  load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
              f"on {os.cpu_count()} cores (other processes skew the figures)")
    dist.destroy_process_group()
    if difference > 1e-5:
        raise SystemExit(f"mpitrain and DDP parameters differ by {difference:.3g}")


if __name__ == "__main__":
    main()
