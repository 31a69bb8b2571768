"""One training step of a model: mpitrain against PyTorch DDP and no communication.

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/train_step.py
                 [--model mlp|resnet50|bert|gpt2] [--steps 20] [--batch N]
                 [--width 2048] [--depth 5] [--json PATH]

--model mlp (the default) is 1024 -> depth x width -> 10 (ReLU; 18.9M
parameters, 1024 -> 5 x 2048 -> 10 by default) on a synthetic batch of 64 per
rank; resnet50, bert and gpt2 are the architectures of benchmarks/models.py
(their real parameter shapes: 161, 201 and 148 gradients) on small synthetic
CPU batches (--batch per rank: 64x64 images, or sequences of 32 tokens).
Every model trains with SGD and momentum, one thread per rank. Five modes
share the same processes and run in turn,
step after step:
  none:      the plain optimizer, no communication (the floor);
  ddp:       torch DistributedDataParallel over gloo;
  mpitrain:  mpitrain.torch.DistributedOptimizer (overlap chosen for the machine);
  mpitrain, overlap=...:  the same with the other overlap choice;
  mpitrain, bf16 on the wire:  the chosen one with compression=Compression.bf16.
A step is zero_grad, forward, backward and optimizer step, timed on the
slowest rank; each mode reports the median and the range (min-max) of its
steps. Ratios between modes are taken step by step (the modes of one step
see the same batch and machine state), then summarised the same way. The
ddp and uncompressed mpitrain models start equal and see the same batches,
so they must end with the same parameters; the bf16 model's gradients are
rounded on the wire, so its distance from ddp is printed, not checked.
A sixth measurement, taken in turn with the others, averages the same
gradients with mpitrain alone (no compute), so the share of communication
hidden behind backward is 1 - (mpitrain - none) / (allreduce alone).
--json PATH writes the medians and ranges per mode, the ratios and the
parameter count (benchmarks/plot_train_step.py collects them).
"""

import argparse
import copy
import json
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
from models import build

INPUTS, CLASSES = 1024, 10          # the MLP's
IMAGE, TOKENS = 64, 32              # the side of resnet50's images, the sequences' length
DEFAULT_BATCH = {"mlp": 64, "resnet50": 1, "bert": 1, "gpt2": 1}
VOCABULARY = {"bert": 30522, "gpt2": 50257}
NONE, DDP, MPITRAIN, BF16 = "none", "ddp", "mpitrain", "mpitrain, bf16 on the wire"
ALONE = "allreduce alone"
# (mode, baseline) pairs whose step-wise ratios are reported.
RATIOS = ((MPITRAIN, NONE), (MPITRAIN, DDP), (BF16, NONE), (BF16, DDP), (DDP, NONE))
ALLOWED_DIFFERENCE = 1e-5


def build_model(width, depth):
    layers, inputs = [], INPUTS
    for _ in range(depth):
        layers += [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
        inputs = width
    layers.append(torch.nn.Linear(inputs, CLASSES))
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


def batch(model, size, step, rank):
    """(inputs, labels) of one synthetic batch, different per step and rank."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    if model == "mlp":
        return (torch.randn(size, INPUTS, generator=generator),
                torch.randint(CLASSES, (size,), generator=generator))
    if model == "resnet50":
        return (torch.randn(size, 3, IMAGE, IMAGE, generator=generator),
                torch.randint(1000, (size,), generator=generator))
    ids = torch.randint(VOCABULARY[model], (size, TOKENS), generator=generator)
    if model == "bert":
        return ids, torch.randint(2, (size,), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)          # gpt2: the next token


def loss_of(outputs, labels):
    """Cross-entropy; a language model's over every position."""
    return torch.nn.functional.cross_entropy(outputs.flatten(0, -2), labels.flatten())


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def distributed_sgd(model, prefix, **options):
    """DistributedOptimizer over SGD; the prefix keeps each mode's tensor
    names apart from the other modes'."""
    return hvd.DistributedOptimizer(
        sgd(model), named_parameters=[(prefix + name, parameter)
                                      for name, parameter in model.named_parameters()],
        **options)


def other_overlap(overlap):
    """The mode with the overlap choice the machine did not make."""
    return f"mpitrain, overlap={not overlap}"


def make_modes(base):
    """Models, forward callables and optimizers of the five modes, in the
    order they take turns: none, ddp, mpitrain (overlap chosen for this
    machine), mpitrain with the other overlap choice (what the choice is
    worth) and mpitrain with bf16 gradients on the wire (overlap chosen)."""
    models = {name: copy.deepcopy(base) for name in (NONE, DDP, MPITRAIN)}
    optimizers = {NONE: sgd(models[NONE]), DDP: sgd(models[DDP]),
                  MPITRAIN: distributed_sgd(models[MPITRAIN], "")}
    overlap = optimizers[MPITRAIN]._overlap
    for name, prefix, options in (
            (other_overlap(overlap), "other.", {"overlap": not overlap}),
            (BF16, "bf16.", {"compression": hvd.Compression.bf16})):
        models[name] = copy.deepcopy(base)
        optimizers[name] = distributed_sgd(models[name], prefix, **options)
    forward = dict(models, **{DDP: DistributedDataParallel(models[DDP])})
    return models, forward, optimizers


def train_step(forward, optimizer, inputs, labels):
    optimizer.zero_grad()
    loss = loss_of(forward(inputs), labels)
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


def slowest(world, fn, *args):
    """Seconds fn(*args) takes on the slowest rank."""
    world.Barrier()
    start = time.perf_counter()
    fn(*args)
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


def time_steps(world, models, forward, optimizers, args):
    """Milliseconds of every timed step per mode (and of the allreduce alone);
    index k of every list is step k. The modes' order rotates every step."""
    modes = list(forward)
    times = {name: [] for name in modes + [ALONE]}
    communicate = None
    for step in range(args.warmup + args.steps):
        inputs, labels = batch(args.model, args.batch, step, world.rank)
        order = modes[step % len(modes):] + modes[:step % len(modes)]
        elapsed = {name: slowest(world, train_step, forward[name], optimizers[name],
                                 inputs, labels) for name in order}
        communicate = communicate or allreduce_alone(models[NONE])
        elapsed[ALONE] = slowest(world, communicate)
        if step >= args.warmup:
            for name, seconds in elapsed.items():
                times[name].append(seconds * 1e3)
    return times


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def step_ratios(times, mode, baseline):
    """Summary of mode / baseline, taken step by step."""
    return summary([ours / theirs for ours, theirs in zip(times[mode], times[baseline])])


def formatted(stats, digits):
    return (f"{stats['median']:.{digits}f} "
            f"({stats['min']:.{digits}f}-{stats['max']:.{digits}f})")


def max_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def print_report(result, world_size, load_before):
    modes, ratios = result["milliseconds"], result["ratios"]
    shape = (f"MLP ({INPUTS} -> {result['depth']} x {result['width']} -> {CLASSES})"
             if result["model"] == "mlp" else result["model"])
    print(f"train step of a {result['parameters'] / 1e6:.1f}M-parameter {shape} "
          f"({result['gradients']} gradients), batch {result['batch']} per rank, "
          f"{world_size} ranks, 1 thread each; {result['steps']} "
          "alternated steps (slowest rank), ms: median (min-max)")
    for name in modes:
        if name == ALONE:
            continue
        label = f"mpitrain (overlap={result['overlap']})" if name == MPITRAIN else name
        print(f"  {label:<28} {formatted(modes[name], 1)} ms")
    alone = modes[ALONE]["median"]
    print(f"  averaging the gradients alone takes {formatted(modes[ALONE], 1)} ms; "
          "hidden behind backward (medians):")
    for name in (MPITRAIN, other_overlap(result["overlap"])):
        added = modes[name]["median"] - modes[NONE]["median"]
        hidden = min(1.0, max(0.0, 1 - added / alone))
        print(f"    {name}: the step adds {added:.1f} ms, {hidden:.0%} of it hidden")
    print("  step-wise ratios: median (min-max)")
    for pair, stats in ratios.items():
        print(f"    {pair:<35} {formatted(stats, 2)}")
    differences = result["max_difference_from_ddp"]
    print(f"  parameters after {result['warmup'] + result['steps']} steps, mpitrain vs ddp: "
          f"max |difference| = {differences[MPITRAIN]:.3g}")
    print(f"  parameters, {BF16} vs ddp: max |difference| = {differences[BF16]:.3g} "
          "(gradients rounded to bf16: not checked)")
    print(f"  load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} cores (other processes skew the figures)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mlp", "resnet50", "bert", "gpt2"),
                        default="mlp")
    parser.add_argument("--batch", type=int, help="per rank (default: by model)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048, help="units per hidden layer")
    parser.add_argument("--depth", type=int, default=5, help="hidden layers")
    parser.add_argument("--json", help="file for the medians, ranges and parameter count")
    args = parser.parse_args()
    args.batch = args.batch or DEFAULT_BATCH[args.model]
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    hvd.init()
    world = MPI.COMM_WORLD.Dup()
    start_gloo(world)
    torch.manual_seed(0)
    base = build_model(args.width, args.depth) if args.model == "mlp" else build(args.model)
    models, forward, optimizers = make_modes(base)
    times = time_steps(world, models, forward, optimizers, args)
    differences = {name: world.allreduce(max_difference(models[DDP], models[name]),
                                         op=MPI.MAX) for name in (MPITRAIN, BF16)}
    result = {
        "ranks": world.size, "model": args.model, "width": args.width,
        "depth": args.depth, "batch": args.batch,
        "parameters": sum(p.numel() for p in base.parameters()),
        "gradients": len(list(base.parameters())),
        "steps": args.steps, "warmup": args.warmup,
        "overlap": optimizers[MPITRAIN]._overlap,
        "milliseconds": {name: summary(values) for name, values in times.items()},
        "ratios": {f"{mode} / {baseline}": step_ratios(times, mode, baseline)
                   for mode, baseline in RATIOS},
        "max_difference_from_ddp": differences,
    }
    if world.rank == 0:
        print_report(result, world.size, load_before)
        if args.json:
            with open(args.json, "w") as stream:
                json.dump(result, stream, indent=1)
    dist.destroy_process_group()
    if differences[MPITRAIN] > ALLOWED_DIFFERENCE:
        raise SystemExit(f"mpitrain and DDP parameters differ by {differences[MPITRAIN]:.3g}")


if __name__ == "__main__":
    main()
