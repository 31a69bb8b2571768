"""Handwritten digits with the optimizer state sharded across ranks (ZeRO-1).

    .venv/bin/mpitrainrun -np 2 python examples/pytorch_sharded_digits.py

The same data and network as pytorch_digits.py, trained with Adam through
ShardedOptimizer: each rank keeps Adam's moments for only its share of the
parameters, updates those, and sends them to the others. The gradients are
averaged in step(), so no DistributedOptimizer is needed. At the end the
full optimizer state is saved with the model, and loaded into a plain
torch.optim.Adam to show that it fits. Without --checkpoint the file goes
into a directory made for this run alone (private to its user), deleted at
the end.
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


def save_and_reload(path, model, optimizer, epochs):
    """Save the model and the whole Adam state (rank 0 writes ``path``, and
    only its path counts), then load them into a plain torch.optim.Adam."""
    hvd.save_checkpoint(path, model, optimizer, epoch=epochs)
    plain_model = network()
    hvd.load_checkpoint(path, plain_model, torch.optim.Adam(plain_model.parameters()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.001, help="for one rank")
    parser.add_argument("--checkpoint", help="where to keep the checkpoint "
                        "(default: a directory of this run's, deleted at the end)")
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

    if args.checkpoint:
        save_and_reload(args.checkpoint, model, optimizer, args.epochs)
    else:
        with tempfile.TemporaryDirectory(prefix="sharded_digits-") as directory:
            save_and_reload(os.path.join(directory, "checkpoint.pt"), model, optimizer,
                            args.epochs)
    shares = hvd.allgather_object(state_bytes(optimizer))
    model.eval()
    correct = torch.zeros(2)                   # right answers, test images
    with torch.no_grad():
        for images, labels in test_batches:
            correct += torch.tensor([(model(images).argmax(1) == labels).sum(), len(labels)])
    right, seen = hvd.allreduce(correct, op=hvd.Sum, name="test.correct").tolist()
    if hvd.rank() == 0:
        kept = (f"saved in {args.checkpoint}" if args.checkpoint else
                "saved and deleted (--checkpoint PATH keeps it)")
        print(f"Adam state per rank: {', '.join(map(str, shares))} bytes "
              f"(of {sum(shares)}), loaded by a plain torch.optim.Adam; {kept}")
        print(f"test accuracy: {right / seen:.2f}")


if __name__ == "__main__":
    main()
