"""One ResNet-50 training step on the GPU: mpitrain against PyTorch DDP and no communication.

Run on a CUDA machine, one rank per GPU or several sharing one:

    mpitrainrun -np 2 python benchmarks/train_step_gpu.py

ResNet-50 (torchvision's where it is installed, else the same network built
here), a synthetic batch of 64 per rank at 224x224, bfloat16 autocast, SGD
with momentum. Three modes share the same processes and take turns, step
after step: none (the plain optimizer), ddp (DistributedDataParallel over
NCCL where every rank has a GPU of its own, else gloo) and mpitrain
(DistributedOptimizer, on the transport the job chooses). A step is
zero_grad, forward, backward and the optimizer step, until the GPU is done,
timed on the slowest rank. Each of --rounds rounds reports medians; the
summary gives the range over rounds. `--device cpu --model small` runs the
same code on a CPU machine, to check the script, not to measure.
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
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mpitrain as mt
import mpitrain.torch as hvd
from mpitrain.transport import selection

from models import resnet


def build_model(name):
    if name == "small":
        return resnet([1, 1, 1, 1], classes=10, base=8)
    try:
        import torchvision
        return torchvision.models.resnet50()
    except ImportError:
        return resnet([3, 4, 6, 3])


def start_torch_distributed(world, backend):
    port = None
    if world.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world.bcast(port)),
                      GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group(backend, init_method="env://", rank=world.rank,
                            world_size=world.size)


def ddp_backend(device, world):
    """NCCL where every rank has a GPU of its own (it refuses a shared one), else gloo."""
    if device.type != "cuda":
        return "gloo"
    mine = torch.cuda.get_device_properties(device).uuid
    everyone = world.allgather((socket.gethostname(), str(mine)))
    return "nccl" if len(set(everyone)) == len(everyone) else "gloo"


def train_step(forward, optimizer, inputs, labels, device):
    optimizer.zero_grad()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(forward(inputs), labels)
    loss.backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_round(world, forward, optimizers, batches, device, warmup):
    """Medians (ms) of each mode's steps, the modes taking turns step by step."""
    modes = list(forward)
    times = {name: [] for name in modes}
    for step, (inputs, labels) in enumerate(batches):
        order = modes[step % len(modes):] + modes[:step % len(modes)]
        for name in order:
            world.Barrier()
            start = time.perf_counter()
            train_step(forward[name], optimizers[name], inputs, labels, device)
            elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if step >= warmup:
                times[name].append(elapsed * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def span(values, digits=1):
    low, high = min(values), max(values)
    return f"{low:.{digits}f}-{high:.{digits}f}" if high - low >= 10 ** -digits / 2 \
        else f"{low:.{digits}f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("resnet50", "small"), default="resnet50")
    parser.add_argument("--batch", type=int, default=64, help="images per rank")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    hvd.init()
    world = MPI.COMM_WORLD.Dup()
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    backend = ddp_backend(device, world)
    start_torch_distributed(world, backend)
    torch.manual_seed(0)
    base = build_model(args.model).to(device).to(memory_format=torch.channels_last)
    models = {name: copy.deepcopy(base) for name in ("none", "ddp", "mpitrain")}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
                  for name, model in models.items()}
    optimizers["mpitrain"] = hvd.DistributedOptimizer(
        optimizers["mpitrain"], named_parameters=models["mpitrain"].named_parameters())
    forward = {"none": models["none"], "ddp": DistributedDataParallel(models["ddp"]),
               "mpitrain": models["mpitrain"]}
    generator = torch.Generator().manual_seed(world.rank)
    batches = [(torch.randn(args.batch, 3, args.image_size, args.image_size,
                            generator=generator).to(device, memory_format=torch.channels_last),
                torch.randint(1000 if args.model == "resnet50" else 10, (args.batch,),
                              generator=generator).to(device))
               for _ in range(args.warmup + args.steps)]
    rounds = [timed_round(world, forward, optimizers, batches, device, args.warmup)
              for _ in range(args.rounds)]
    difference = world.allreduce(max(
        (p - q).abs().max().item()
        for p, q in zip(models["ddp"].parameters(), models["mpitrain"].parameters())),
        op=MPI.MAX)
    if world.rank == 0:
        count = sum(p.numel() for p in base.parameters())
        engine = mt.api.basics.engine()
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"train step, {args.model} ({count / 1e6:.1f}M parameters), batch "
              f"{args.batch} per rank at {args.image_size}x{args.image_size}, bf16 "
              f"autocast, {world.size} rank(s) on {where}")
        print(f"  mpitrain's device transport: "
              f"{selection.describe(engine.device_plan, engine.cuda_aware)}")
        print(f"  DDP backend: {backend}; {args.rounds} rounds of {args.steps} steps "
              "per mode, medians of the slowest rank per round, range over rounds:")
        for name in forward:
            print(f"    {name:<9} {span([r[name] for r in rounds])} ms")
        goals = {("mpitrain", "none", 1): "goal of docs/gpu.md's speed table: at most 1.03",
                 ("mpitrain", "ddp", 2): "goal of docs/gpu.md's speed table, staged: "
                                         "at most 0.75"}
        for mode, baseline in (("mpitrain", "none"), ("mpitrain", "ddp"), ("ddp", "none")):
            ratios = [r[mode] / r[baseline] for r in rounds]
            goal = goals.get((mode, baseline, world.size))
            print(f"  {mode} / {baseline}: {span(ratios, 2)}" + (f" ({goal})" if goal else ""))
        print(f"  parameters after the runs, mpitrain vs ddp: max |difference| = "
              f"{difference:.3g} (bf16 autocast: not bitwise)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
