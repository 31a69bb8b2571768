"""DiLoCo on the digits example: final loss, exchanges, bytes and step time against synchronous training.

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/diloco.py
                 [--epochs 20] [--repeats 3] [--inner-steps 20] [--fragments 4]

The network, data and shards of examples/pytorch_digits.py, batch 32 per
rank, one thread per rank. Each repeat trains, in turn and from the same
start (the repeat's seed picks the initial weights and the shuffling):

- synchronous (the baseline): DistributedOptimizer over AdamW (lr 1e-3),
  gradients averaged every step;
- DiLoCo, H inner steps: DiLoCoOptimizer over the same AdamW (DiLoCo's
  inner optimizer) on each rank's own gradients, the default outer SGD
  (lr 0.7, momentum 0.9, Nesterov), float32 pseudo-gradients;
- streaming DiLoCo: the same with the model in --fragments fragments, each
  exchange overlapping one inner step (mixing 0.5) and int8 pseudo-gradients;
- local SGD, K = H: LocalSGDOptimizer (DiLoCo with an outer lr of 1 and
  no momentum), for comparison.

DiLoCo's runs end with synchronize_parameters(), local SGD's with
average_parameters(), so every rank holds the model that is evaluated.

Reported per mode: the final training loss (mean cross-entropy over every
training image) and its ratio to the baseline's, test accuracy (min-max
over repeats), exchanges per step (one a step for the baseline: its
gradients; a streaming exchange carries one fragment of the model), the bytes each rank submits per step
(counted from the payloads: gradients for the baseline, parameters for
local SGD, pseudo-gradients after compression for DiLoCo), and the time per
step as a ratio to the baseline's in the same repeat (min-max). Losses and
bytes do not depend on machine load; times do.
"""

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import mpitrain.torch as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "examples"))
from pytorch_digits import datasets, network  # noqa: E402
from pytorch_local_sgd_digits import nbytes  # noqa: E402
from local_sgd import accuracy, span  # noqa: E402  (benchmarks/local_sgd.py)

BATCH, LR = 32, 1e-3
MODES = ("synchronous", "DiLoCo", "streaming int8", "local SGD")


def build(mode, model, args):
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    named = model.named_parameters()
    if mode == "synchronous":
        return hvd.DistributedOptimizer(inner, named_parameters=named)
    if mode == "local SGD":
        return hvd.LocalSGDOptimizer(inner, named, period=args.inner_steps,
                                     overlap_averaging=False)
    if mode == "DiLoCo":
        return hvd.DiLoCoOptimizer(inner, named, inner_steps=args.inner_steps)
    return hvd.DiLoCoOptimizer(inner, named, inner_steps=args.inner_steps,
                               fragments=args.fragments, overlap_steps=1,
                               compression=hvd.Compression.int8())


def train(mode, args, train_set, test_set, seed):
    """(final training loss, test accuracy, exchanges, bytes sent, steps, seconds)."""
    torch.manual_seed(seed)
    model = network()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 drop_last=True, seed=seed)
    batches = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    optimizer = build(mode, model, args)
    hvd.barrier()
    started = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for images, labels in batches:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
    if mode == "local SGD":
        optimizer.average_parameters()
    elif mode != "synchronous":
        optimizer.synchronize_parameters()
    seconds = time.perf_counter() - started
    steps = args.epochs * len(batches)
    parameter_bytes = nbytes(model.parameters())
    if mode == "synchronous":
        exchanges, sent = steps, steps * parameter_bytes
    elif mode == "local SGD":
        exchanges = steps // args.inner_steps + 1
        sent = exchanges * parameter_bytes
    else:
        exchanges, sent = optimizer.exchanges, optimizer.bytes_sent
    return (mean_loss(model, train_set), accuracy(model, test_set), exchanges, sent,
            steps, seconds)


def mean_loss(model, train_set):
    shard = Subset(train_set, range(hvd.rank(), len(train_set), hvd.size()))
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for images, labels in DataLoader(shard, batch_size=256):
            loss = torch.nn.functional.cross_entropy(model(images), labels, reduction="sum")
            total += torch.tensor([loss.item(), len(labels)], dtype=torch.float64)
    loss_sum, seen = hvd.allreduce(total, op=hvd.Sum, name="benchmark.loss").tolist()
    return loss_sum / seen


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=4)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    train_set, test_set = datasets()
    results = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            results[mode].append(train(mode, args, train_set, test_set, seed=repeat))
    if hvd.rank() != 0:
        return
    baseline = results["synchronous"]
    print(f"digits, {hvd.size()} ranks, {args.epochs} epochs ({baseline[0][4]} steps), "
          f"{args.repeats} repeats; H={args.inner_steps}, {args.fragments} fragments "
          "when streaming")
    print(f"{'mode':<16} {'final loss':>15} {'loss/sync':>11} {'test acc':>12} "
          f"{'exchanges/step':>15} {'bytes/step':>11} {'bytes/sync':>11} {'step time/sync':>15}")
    for mode in MODES:
        runs = results[mode]
        losses = [run[0] / base[0] for run, base in zip(runs, baseline)]
        times = [run[5] / base[5] for run, base in zip(runs, baseline)]
        _, _, exchanges, sent, steps, _ = runs[0]
        name = {"DiLoCo": f"DiLoCo H={args.inner_steps}",
                "local SGD": f"local SGD K={args.inner_steps}"}.get(mode, mode)
        print(f"{name:<16} {span([r[0] for r in runs], '{:.4f}'):>15} "
              f"{span(losses, '{:.3f}'):>11} {span([r[1] for r in runs], '{:.3f}'):>12} "
              f"{exchanges / steps:>15.4f} {sent / steps:>11.0f} "
              f"{sent / baseline[0][3]:>11.4f} {span(times, '{:.2f}'):>15}")


if __name__ == "__main__":
    main()
