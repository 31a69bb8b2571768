"""Handwritten digits in mixed precision: autocast, GradScaler and no_sync().

    .venv/bin/mpitrainrun -np 2 python examples/pytorch_amp_digits.py [--dtype float16]

The network, data and shards of pytorch_digits.py, trained under
torch.autocast. With float16 a GradScaler scales the loss, and sees the
gradients after they are averaged across ranks (optimizer.synchronize()),
so an overflow on any rank skips the step on every rank. bfloat16 needs no
scaler; it is the default on the CPU, where float16 kernels are slow.
Each batch is cut into --micro-batches parts; all but the last run their
backward pass inside optimizer.no_sync(), so gradients travel once per batch.
"""

import argparse

import torch
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import mpitrain.torch as hvd
from pytorch_digits import datasets, network


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01, help="for one rank")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                        help="float16 on a GPU, bfloat16 on the CPU by default")
    args = parser.parse_args()

    hvd.init()
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() \
        else torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda"
                                          else "bfloat16"))
    torch.manual_seed(hvd.rank())          # the broadcast below makes the weights equal
    torch.set_num_threads(1)
    train, test = datasets()
    train_sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(),
                                       drop_last=True)
    train_batches = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler)
    test_shard = Subset(test, range(hvd.rank(), len(test), hvd.size()))

    model = network().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # bfloat16 has float32's range: nothing overflows, the scaler passes through.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def backward(images, labels):
        with torch.autocast(device.type, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(images.to(device)),
                                                     labels.to(device))
        scaler.scale(loss / args.micro_batches).backward()

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for images, labels in train_batches:
            optimizer.zero_grad()
            parts = list(zip(images.chunk(args.micro_batches),
                             labels.chunk(args.micro_batches)))
            with optimizer.no_sync():       # accumulate locally, send nothing
                for part in parts[:-1]:
                    backward(*part)
            backward(*parts[-1])            # sends the sum of every part's gradients
            optimizer.synchronize()         # averaged now: the scaler sees the average
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)      # skipped on every rank after an overflow
            scaler.update()

    model.eval()
    correct = torch.zeros(2)                   # right answers, test images
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
        for images, labels in DataLoader(test_shard, batch_size=256):
            guesses = model(images.to(device)).argmax(1).cpu()
            correct += torch.tensor([(guesses == labels).sum(), len(labels)])
    right, seen = hvd.allreduce(correct, op=hvd.Sum, name="test.correct").tolist()
    if hvd.rank() == 0:
        print(f"test accuracy: {right / seen:.2f}")


if __name__ == "__main__":
    main()
