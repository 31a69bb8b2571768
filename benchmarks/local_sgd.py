"""Local SGD on the digits example: accuracy and bytes sent for K = 1, 4, 16.

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/local_sgd.py
                 [--epochs 15] [--warmup-epochs 1] [--repeats 3] [--periods 1 4 16]

The network, data and shards of examples/pytorch_digits.py; SGD with
momentum 0.9 at lr 0.01 x ranks, batch 32 per rank, one thread per rank.
Each repeat trains, in turn and from the same start, the baseline
(DistributedOptimizer: gradients averaged every step) and
LocalSGDOptimizer for each period K (one warm-up epoch of averaged
gradients, then K local steps per average of the parameters, the average
overlapping the next step; average_parameters() once at the end).

Reported per mode: test accuracy (min-max over repeats), the bytes each rank
submits to allreduces (counted from the tensors sent: gradients in
synchronous steps, parameters in averages) and their ratio to the
baseline's, and the training time's ratio to the baseline's in the same
repeat (min-max). Bytes and accuracy do not depend on machine load; times do.
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
from pytorch_local_sgd_digits import local_sgd_bytes, nbytes  # noqa: E402

BATCH, LR, MOMENTUM = 32, 0.01, 0.9
BASELINE = "gradients every step"


def train(period, epochs, warmup_epochs, train_set, test_set):
    """(test accuracy, bytes this rank submitted, seconds) of one training."""
    torch.manual_seed(0)
    model = network()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 drop_last=True, seed=0)
    batches = DataLoader(train_set, batch_size=BATCH, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=MOMENTUM)
    warmup = warmup_epochs * len(batches)
    if period is None:
        optimizer = hvd.DistributedOptimizer(optimizer,
                                             named_parameters=model.named_parameters())
    else:
        optimizer = hvd.LocalSGDOptimizer(optimizer, model.named_parameters(), period=period,
                                          warmup_steps=warmup)
    hvd.barrier()
    started = time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in batches:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
    if period is not None:
        optimizer.average_parameters()
    seconds = time.perf_counter() - started
    parameter_bytes, steps = nbytes(model.parameters()), epochs * len(batches)
    sent = (parameter_bytes * steps if period is None
            else local_sgd_bytes(parameter_bytes, steps, warmup, period))
    return accuracy(model, test_set), sent, seconds


def accuracy(model, test_set):
    shard = Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    correct = torch.zeros(2)
    with torch.no_grad():
        for images, labels in DataLoader(shard, batch_size=256):
            correct += torch.tensor([(model(images).argmax(1) == labels).sum(), len(labels)])
    right, seen = hvd.allreduce(correct, op=hvd.Sum, name="benchmark.correct").tolist()
    return right / seen


def span(values, form):
    low, high = min(values), max(values)
    return form.format(low) if low == high else f"{form.format(low)}-{form.format(high)}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--periods", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    train_set, test_set = datasets()
    modes = [None] + args.periods
    results = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            results[mode].append(train(mode, args.epochs, args.warmup_epochs, train_set,
                                       test_set))
    if hvd.rank() != 0:
        return
    print(f"digits, {hvd.size()} ranks, {args.epochs} epochs, {args.repeats} repeats; "
          f"local SGD after {args.warmup_epochs} warm-up epoch(s)")
    print(f"{'mode':<22} {'test accuracy':>14} {'MB sent/rank':>13} {'bytes/baseline':>15} "
          f"{'time/baseline':>14}")
    baseline = results[None]
    for mode in modes:
        runs = results[mode]
        name = BASELINE if mode is None else f"local SGD, K={mode}"
        times = [seconds / base[2] for (_, _, seconds), base in zip(runs, baseline)]
        print(f"{name:<22} {span([a for a, _, _ in runs], '{:.3f}'):>14} "
              f"{runs[0][1] / 1e6:>13.2f} {runs[0][1] / baseline[0][1]:>15.3f} "
              f"{span(times, '{:.2f}'):>14}")


if __name__ == "__main__":
    main()
