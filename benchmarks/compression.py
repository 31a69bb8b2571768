"""Gradient compressors against none: bytes per step, step time, and accuracy on digits.

Run on 2 ranks:  mpitrainrun -np 2 python benchmarks/compression.py
                 [--epochs 40] [--repeats 3] [--hidden 256] [--cases none,topk,...]

An MLP 64 -> hidden -> hidden -> 10 (ReLU) learns scikit-learn's digits
(1347 training images split across the ranks, 450 test images; nothing is
downloaded) with SGD and momentum, 32 images per rank and step, from the
same seed in every case. Each case trains ``--repeats`` times from scratch
and reports:
  bytes/step: what this rank's collectives carry per step (compressed
    payloads, and the parameters left uncompressed: biases; fp16 counts as
    float32, which is what the engine sends on the CPU), against none.
    On 2 ranks an allreduce and an allgather each move about that much per
    rank; beyond 2 an allgather's receive grows with the ranks.
  step time: the mean of a run's steps (zero_grad, forward, backward,
    step; evaluation excluded), its range over the repeats, and the ratio
    of medians against none.
  accuracy: on the test images after the last epoch (the same in every
    repeat: seeds are fixed and the sums are in a fixed order).
Bytes and accuracy do not depend on the machine's load; times do.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import mpitrain.torch as hvd

BATCH = 32      # per rank


def cases():
    """name -> a function giving a fresh compression= value (state is per run)."""
    C = hvd.Compression
    made = {"none": lambda: C.none, "fp16": lambda: C.fp16}
    for name, make in (("topk 1%", lambda ef: C.topk(0.01, ef)),
                       ("onebit", lambda ef: C.onebit(error_feedback=ef)),
                       ("int8", lambda ef: C.int8(error_feedback=ef)),
                       ("int4", lambda ef: C.int4(error_feedback=ef)),
                       ("powersgd r4", lambda ef: C.powersgd(4, ef))):
        made[f"{name} + EF"] = lambda make=make: make(True)
        made[f"{name}, no EF"] = lambda make=make: make(False)
    return made


def data():
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train_x, test_x, train_y, test_y = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y)
    return train_x, train_y, test_x, test_y


def network(hidden):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def uncompressed_bytes(model, compression):
    """Bytes per step of the parameters that go through the plain allreduce."""
    if isinstance(compression, hvd.compression.GradientCompressor):
        return sum(p.numel() * 4 for p in model.parameters()
                   if not compression.applies_to(p))
    # On the CPU the engine reduces 16-bit floats in a float32 buffer, which
    # is what travels (docs/design.md): fp16 and bf16 save no bytes there.
    cast = compression in (hvd.Compression.fp16, hvd.Compression.bf16)
    wire = 2 if cast and any(p.is_cuda for p in model.parameters()) else 4
    return sum(p.numel() * wire for p in model.parameters())


def run(compression, args, train_x, train_y, test_x, test_y):
    """(bytes per step, mean step seconds, test accuracy) of one training run."""
    r, n = hvd.rank(), hvd.size()
    model = network(args.hidden)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(), compression=compression)
    steps_per_epoch = len(train_x) // (BATCH * n)
    seconds, steps = 0.0, 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps_per_epoch):
            rows = order[(step * n + r) * BATCH:(step * n + r + 1) * BATCH]
            hvd.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(train_x[rows]), train_y[rows]).backward()
            optimizer.step()
            seconds += time.perf_counter() - start
            steps += 1
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    sent = getattr(compression, "bytes_sent", 0) + steps * uncompressed_bytes(model, compression)
    slowest = max(hvd.allgather_object(seconds / steps))
    return sent / steps, slowest, accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--cases", default="", help="comma-separated names (default all)")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    everything = cases()
    chosen = [name.strip() for name in args.cases.split(",") if name.strip()] \
        or list(everything)
    if "none" not in chosen:
        chosen.insert(0, "none")
    arrays = data()
    results = {}
    for name in chosen:
        runs = [run(everything[name](), args, *arrays) for _ in range(args.repeats)]
        results[name] = runs
    if hvd.rank() != 0:
        return
    base_bytes = results["none"][0][0]
    base_time = statistics.median(seconds for _, seconds, _ in results["none"])
    base_accuracy = results["none"][0][2]
    print(f"{hvd.size()} ranks, MLP 64-{args.hidden}-{args.hidden}-10, {args.epochs} "
          f"epochs, {args.repeats} runs per case; bytes per rank and step")
    print(f"{'case':<22}{'bytes/step':>12}{'vs none':>9}{'ms/step (range)':>22}"
          f"{'time vs none':>14}{'accuracy':>10}{'vs none':>9}")
    for name, runs in results.items():
        sent = runs[0][0]
        times = [seconds * 1e3 for _, seconds, _ in runs]
        accuracies = sorted({round(accuracy, 4) for _, _, accuracy in runs})
        accuracy = accuracies[0] if len(accuracies) == 1 else accuracies
        ratio = statistics.median(times) / (base_time * 1e3)
        print(f"{name:<22}{sent:>12,.0f}{sent / base_bytes:>9.3f}"
              f"{statistics.median(times):>10.2f} ({min(times):.2f}-{max(times):.2f})"
              f"{ratio:>14.2f}{runs[0][2]:>10.4f}{(runs[0][2] - base_accuracy) * 100:>+8.1f}"
              + ("" if len(accuracies) == 1 else f"  accuracy varied: {accuracy}"))


if __name__ == "__main__":
    main()
