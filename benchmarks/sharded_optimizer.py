"""ShardedOptimizer stages 1 and 2 against DistributedOptimizer: step time, bytes, memory.

Run on N ranks (mpitrainrun adds --oversubscribe beyond the cores):
    mpitrainrun -np 2 python benchmarks/sharded_optimizer.py --model bert
    [--model mlp|bert|gpt2] [--width 1024] [--depth 8] (the MLP's)
    [--steps 3] [--rounds 5] [--optimizer adam|sgd] [--memory]

--model mlp is 1024 -> depth x width -> 10 (ReLU) on a synthetic batch of
32 per rank; bert and gpt2 are the architectures of benchmarks/models.py
(bert-base, 109.5M parameters; GPT-2 small, 124.4M) on one synthetic
sequence of 32 tokens per rank. One thread per rank.

Step time: three copies of the model start equal and see the same batches,
one with DistributedOptimizer, one with ShardedOptimizer (stage 1), one
with ShardedOptimizer(stage=2). Each round times ``steps`` steps of each
mode, alternating step by step; a step (zero_grad, forward, backward,
optimizer step) is timed on the slowest rank. Printed: the optimizer
state on each rank, the median step time of each mode with its range over
the rounds, the ratios stage 2 / stage 1 and each stage / distributed (per
round, then their range), and the largest difference between the models'
parameters at the end.

Bytes per step: what one rank sends with ring algorithms, from the sizes
the optimizers hand to the collectives (padding included): an allreduce of
B bytes sends 2(N-1)/N B (DistributedOptimizer); a reduce-scatter of B
sends (N-1)/N B and an allgather of a B-byte share (N-1) B (both stages).

Peak memory (--memory, instead of the step times: a launch of its own):
DistributedOptimizer and stage 2 are each built alone and run ``steps``
steps; the peak resident memory of the process (VmHWM, reset through
/proc/self/clear_refs) less the resident memory before the model was built
is that mode's: parameters, gradients, state, activations and buffers.
glibc then maps every allocation from 128 KiB up on its own, so that a
freed tensor leaves the resident memory at once. That makes every step
fault its new pages in again (the steps took 1.2 to 1.5 times as long),
so the step times run in another launch, with glibc's defaults, as users'
training does.
Both orders run, each mode measured after the other; the ratio stage 2 /
distributed is printed for each order, on the rank where it is largest.
"""

import argparse
import copy
import ctypes
import gc
import statistics
import time

import torch

import mpitrain.torch as hvd
from models import build
from train_step import CLASSES, INPUTS, batch, build_model, loss_of

MLP_BATCH = 32
OPTIMIZERS = {"adam": (torch.optim.Adam, dict(lr=1e-4)),
              "sgd": (torch.optim.SGD, dict(lr=0.01, momentum=0.9))}
DISTRIBUTED, STAGE_1, STAGE_2 = "distributed", "stage 1", "stage 2"
M_MMAP_THRESHOLD = -3


def make_model(args):
    torch.manual_seed(0)
    return build_model(args.width, args.depth) if args.model == "mlp" else build(args.model)


def make_optimizer(mode, model, args, prefix=""):
    optimizer_class, options = OPTIMIZERS[args.optimizer]
    if mode == DISTRIBUTED:
        return hvd.DistributedOptimizer(
            optimizer_class(model.parameters(), **options),
            named_parameters=[(prefix + name, p) for name, p in model.named_parameters()])
    return hvd.ShardedOptimizer(optimizer_class, model.parameters(),
                                stage=1 if mode == STAGE_1 else 2, **options)


def inputs(args, step):
    if args.model == "mlp":
        generator = torch.Generator().manual_seed(1000 * step + hvd.rank())
        return (torch.randn(MLP_BATCH, INPUTS, generator=generator),
                torch.randint(0, CLASSES, (MLP_BATCH,), generator=generator))
    return batch(args.model, 1, step, hvd.rank())


def timed_step(model, optimizer, x, y):
    """Seconds of one training step on the slowest rank."""
    started = time.perf_counter()
    optimizer.zero_grad()
    loss_of(model(x), y).backward()
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    return hvd.allreduce(elapsed, op=hvd.Max, name="step_time").item()


def state_bytes(optimizer):
    return sum(value.nbytes for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


def sent_per_step(mode, optimizer, model):
    """Bytes one rank sends in a step, with ring algorithms."""
    n = hvd.size()
    if mode == DISTRIBUTED:
        gradients = sum(p.numel() * p.element_size() for p in model.parameters()
                        if p.requires_grad)
        return 2 * (n - 1) / n * gradients
    scattered, gathered = optimizer.exchanged_bytes
    return (n - 1) / n * scattered + (n - 1) * gathered


def summary(values):
    return f"{statistics.median(values):.4g} (range {min(values):.4g}-{max(values):.4g})"


def resident_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def release_memory():
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)


def peak_memory(mode, args):
    """KiB of resident memory this mode added at its peak: its model built,
    ``steps`` steps taken."""
    release_memory()
    before = resident_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")                    # VmHWM starts again from VmRSS
    model = make_model(args)
    optimizer = make_optimizer(mode, model, args, prefix=f"memory.{mode}.")
    for step in range(args.steps):
        timed_step(model, optimizer, *inputs(args, step))
    peak = resident_kib("VmHWM") - before
    del model, optimizer
    release_memory()
    return peak


def compare_memory(args):
    """Each mode's peak, in both orders; printed on rank 0."""
    # Large tensors in their own mappings, so that freeing one lowers the
    # resident memory at once (glibc otherwise raises the threshold).
    ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    for mode in (DISTRIBUTED, STAGE_2):
        peak_memory(mode, args)     # the engine's and MPI's buffers grow once, here
    memory = []
    for order in ((DISTRIBUTED, STAGE_2), (STAGE_2, DISTRIBUTED)):
        peaks = {mode: peak_memory(mode, args) for mode in order}
        memory.append((order, max(hvd.allgather_object(peaks[STAGE_2] /
                                                       peaks[DISTRIBUTED])), peaks))
    if hvd.rank() == 0:
        print(f"{args.model}, {args.optimizer}, {hvd.size()} ranks, peak memory over "
              f"{args.steps} steps")
        for order, ratio, peaks in memory:
            print(f"  peak memory, {' then '.join(order)} (rank 0, MiB): " + ", ".join(
                f"{mode} {peaks[mode] / 1024:.0f}" for mode in order) +
                f"; stage 2 / distributed, largest over ranks: {ratio:.3f}")


def compare_steps(args):
    """The three modes' step times, state, bytes and final parameters; printed on rank 0."""
    base = make_model(args)
    modes = {}
    for mode in (DISTRIBUTED, STAGE_1, STAGE_2):
        model = copy.deepcopy(base)
        modes[mode] = (model, make_optimizer(mode, model, args))
    del base
    for model, optimizer in modes.values():       # warm-up; creates the state
        timed_step(model, optimizer, *inputs(args, 0))

    medians = {mode: [] for mode in modes}
    step = 0
    for _ in range(args.rounds):
        times = {mode: [] for mode in modes}
        for _ in range(args.steps):
            step += 1
            for mode, (model, optimizer) in modes.items():
                times[mode].append(timed_step(model, optimizer, *inputs(args, step)))
        for mode in modes:
            medians[mode].append(statistics.median(times[mode]))

    held = {mode: hvd.allgather_object(state_bytes(optimizer))
            for mode, (_, optimizer) in modes.items()}
    sent = {mode: max(hvd.allgather_object(sent_per_step(mode, optimizer, model)))
            for mode, (model, optimizer) in modes.items()}
    reference = modes[DISTRIBUTED][0]
    difference = {mode: max((p - q).abs().max().item() for p, q in
                            zip(reference.parameters(), model.parameters()))
                  for mode, (model, _) in modes.items() if mode != DISTRIBUTED}
    parameters = sum(p.numel() for p in reference.parameters())

    if hvd.rank() == 0:
        print(f"{args.model}, {args.optimizer}, {parameters} parameters, {hvd.size()} ranks, "
              f"{args.rounds} rounds of {args.steps} steps per mode")
        for mode, per_rank in held.items():
            print(f"  {mode:<12} optimizer state per rank (bytes): "
                  f"{', '.join(map(str, per_rank))}; largest / unsharded = "
                  f"{max(per_rank) / max(held[DISTRIBUTED]):.3f}")
        for mode in medians:
            print(f"  {mode:<12} step time (s): {summary(medians[mode])}; sent per "
                  f"step and rank: {sent[mode] / 2**20:.1f} MiB "
                  f"({sent[mode] / sent[DISTRIBUTED]:.3f} x distributed)")
        for mode, baseline in ((STAGE_2, STAGE_1), (STAGE_1, DISTRIBUTED),
                               (STAGE_2, DISTRIBUTED)):
            ratios = [a / b for a, b in zip(medians[mode], medians[baseline])]
            print(f"  {mode} / {baseline} step time: {summary(ratios)}")
        for mode, value in difference.items():
            print(f"  max |parameter difference| {mode} - distributed at the end: "
                  f"{value:.3g}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mlp", "bert", "gpt2"), default="mlp")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="per round and mode")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--memory", action="store_true",
                        help="peak memory instead of step times")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    (compare_memory if args.memory else compare_steps)(args)


if __name__ == "__main__":
    main()
