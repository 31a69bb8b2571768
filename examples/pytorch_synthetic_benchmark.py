"""Training throughput of a ResNet on random images, in images/sec per rank
and in total, with mpitrain.torch averaging the gradients.

    .venv/bin/mpitrainrun -np 2 python examples/pytorch_synthetic_benchmark.py

The same measurement as Horovod's PyTorch synthetic benchmark: warm-up
batches, then iterations of several batches each; every figure is the mean
over iterations +- 1.96 standard deviations. The ResNets are defined here
(torchvision is not needed), and the defaults are sized for a CPU.
"""

import argparse
import timeit

import numpy as np
import torch
from torch import nn

import mpitrain.torch as hvd

STAGES = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


class Block(nn.Module):
    """Two 3x3 convolutions and a shortcut: ResNet's basic block."""

    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs),
            nn.ReLU(inplace=True),
            nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False), nn.BatchNorm2d(outputs))
        self.shortcut = nn.Identity() if stride == 1 and inputs == outputs else nn.Sequential(
            nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet(name, classes=1000):
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
              nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    width = 64
    for stage, blocks in enumerate(STAGES[name]):
        outputs = 64 * 2 ** stage
        for block in range(blocks):
            layers.append(Block(width, outputs, 2 if stage and not block else 1))
            width = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)]
    return nn.Sequential(*layers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(STAGES), default="resnet18")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--num-warmup-batches", type=int, default=2)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send the gradients as float16")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    model = resnet(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(1000, (args.batch_size,))

    def step():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    def say(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    say(f"model {args.model}, batch size {args.batch_size} per rank, "
        f"{args.image_size}x{args.image_size} images, {hvd.size()} ranks, "
        f"{'fp16' if args.fp16_allreduce else 'fp32'} gradients")
    say(f"warming up: {args.num_warmup_batches} batches")
    timeit.timeit(step, number=args.num_warmup_batches)
    rates = []                                  # per iteration: every rank's rate
    for iteration in range(args.num_iters):
        seconds = timeit.timeit(step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / seconds
        rates.append(hvd.allgather(torch.tensor([rate]), name="rate").numpy())
        say(f"iteration {iteration}: {rates[-1].mean():.1f} images/sec per rank")
    rates = np.array(rates)
    per_rank, total = rates.mean(axis=1), rates.sum(axis=1)
    say(f"images/sec per rank: {per_rank.mean():.1f} +-{1.96 * per_rank.std():.1f}")
    say(f"total images/sec on {hvd.size()} ranks: {total.mean():.1f} "
        f"+-{1.96 * total.std():.1f}")


if __name__ == "__main__":
    main()
