"""ShardedOptimizer (ZeRO-1) against DistributedOptimizer: Adam's state per rank, step time.

Run on N ranks (mpitrainrun adds --oversubscribe beyond the cores):
    for n in 1 2 3 4; do mpitrainrun -np $n python benchmarks/sharded_optimizer.py; done
    [--width 1024] [--depth 8] [--steps 10] [--rounds 5] [--optimizer adam|sgd]

The model is 1024 -> depth x width -> 10 (ReLU), trained on a synthetic batch
of 32 per rank, one thread per rank. Two copies start equal and see the same
batches: one with DistributedOptimizer(Adam), one with ShardedOptimizer(Adam).
Each round times ``steps`` steps of each mode, alternating step by step; a
step (zero_grad, forward, backward, optimizer step) is timed on the slowest
rank. Printed: the bytes of optimizer state on each rank for both modes and
their ratio, the median step time of each mode with its range over the
rounds, the ratio sharded / distributed (per round, then its range), and
the largest difference between the two models' parameters at the end.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from train_step import CLASSES, INPUTS, build_model

BATCH = 32
OPTIMIZERS = {"adam": (torch.optim.Adam, dict(lr=1e-4)),
              "sgd": (torch.optim.SGD, dict(lr=0.01, momentum=0.9))}


def state_bytes(optimizer):
    return sum(value.nbytes for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


def timed_step(model, optimizer, x, y):
    """Seconds of one training step on the slowest rank."""
    started = time.perf_counter()
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    return hvd.allreduce(elapsed, op=hvd.Max, name="step_time").item()


def summary(values):
    return f"{statistics.median(values):.4g} (range {min(values):.4g}-{max(values):.4g})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="per round and mode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    optimizer_class, options = OPTIMIZERS[args.optimizer]
    torch.manual_seed(0)
    distributed_model = build_model(args.width, args.depth)
    sharded_model = copy.deepcopy(distributed_model)
    modes = {
        "distributed": (distributed_model, hvd.DistributedOptimizer(
            optimizer_class(distributed_model.parameters(), **options),
            named_parameters=distributed_model.named_parameters())),
        "sharded": (sharded_model, hvd.ShardedOptimizer(
            optimizer_class, sharded_model.parameters(), **options)),
    }
    generator = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(BATCH, INPUTS, generator=generator)
    y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    for model, optimizer in modes.values():       # warm-up; creates the state
        timed_step(model, optimizer, x, y)

    medians = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        times = {mode: [] for mode in modes}
        for _ in range(args.steps):
            for mode, (model, optimizer) in modes.items():
                times[mode].append(timed_step(model, optimizer, x, y))
        for mode in modes:
            medians[mode].append(statistics.median(times[mode]))

    held = {mode: hvd.allgather_object(state_bytes(optimizer))
            for mode, (_, optimizer) in modes.items()}
    difference = max((p - q).abs().max().item() for p, q in
                     zip(distributed_model.parameters(), sharded_model.parameters()))
    if hvd.rank() == 0:
        parameters = sum(p.numel() for p in sharded_model.parameters())
        print(f"{args.optimizer}, {parameters} parameters, {hvd.size()} ranks, "
              f"{args.rounds} rounds of {args.steps} steps per mode")
        for mode, per_rank in held.items():
            print(f"  {mode:<12} optimizer state per rank (bytes): "
                  f"{', '.join(map(str, per_rank))}; largest / unsharded = "
                  f"{max(per_rank) / max(held['distributed']):.3f}")
        for mode in modes:
            print(f"  {mode:<12} step time (s): {summary(medians[mode])}")
        ratios = [s / d for s, d in zip(medians["sharded"], medians["distributed"])]
        print(f"  sharded / distributed step time: {summary(ratios)}")
        print(f"  max |parameter difference| at the end: {difference:.3g}")


if __name__ == "__main__":
    main()
