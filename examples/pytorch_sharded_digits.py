"""Handwritten digits with the optimizer state sharded across ranks (ZeRO-1).

    .venv/bin/mpitrainrun -np 2 python examples/pytorch_sharded_digits.py

The same data and network as pytorch_digits.py, trained with Adam through
ShardedOptimizer: each rank keeps Adam's moments for only its share of the
parameters, updates those, and sends them to the others. The gradients are
averaged in step(), so no DistributedOptimizer is needed. At the end the
full optimizer state is saved with the model, loadable into a plain
torch.optim.Adam.
"""

import argparse
import os
import tempfile

import torch
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import mpitrain.torch as hvd
from pytorch_digits import datasets, network


def state_bytes(optimizer):
    return sum(value.nbytes for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.001, help="for one rank")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                             "sharded_digits.pt"))
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(hvd.rank())          # the broadcast below makes the weights equal
    torch.set_num_threads(1)
    train, test = datasets()
    train_sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(),
                                       drop_last=True)
    train_batches = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler)
    test_batches = DataLoader(Subset(test, range(hvd.rank(), len(test), hvd.size())),
                              batch_size=256)

    model = network()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.ShardedOptimizer(torch.optim.Adam, model.parameters(),
                                     lr=args.lr * hvd.size())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)

    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for images, labels in train_batches:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
        scheduler.step()

    hvd.save_checkpoint(args.checkpoint, model, optimizer, epoch=args.epochs)
    shares = hvd.allgather_object(state_bytes(optimizer))
    model.eval()
    correct = torch.zeros(2)                   # right answers, test images
    with torch.no_grad():
        for images, labels in test_batches:
            correct += torch.tensor([(model(images).argmax(1) == labels).sum(), len(labels)])
    right, seen = hvd.allreduce(correct, op=hvd.Sum, name="test.correct").tolist()
    if hvd.rank() == 0:
        print(f"Adam state per rank: {', '.join(map(str, shares))} bytes "
              f"(of {sum(shares)}); saved in {args.checkpoint}")
        print(f"test accuracy: {right / seen:.2f}")


if __name__ == "__main__":
    main()
