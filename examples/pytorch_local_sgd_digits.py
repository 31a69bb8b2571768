"""Handwritten digits with local SGD: ranks step alone, parameters averaged every K steps.

    .venv/bin/mpitrainrun -np 2 python examples/pytorch_local_sgd_digits.py [--period 4]

The network, data and shards of pytorch_digits.py, trained with
LocalSGDOptimizer: the first epoch is synchronous (gradients averaged every
step, as DistributedOptimizer does) so the model leaves the steep start of
training together; then each rank steps on its own shard's gradients and
the parameters are averaged every --period steps. average_parameters()
before the test makes the ranks' models identical again. Rank 0 prints the
bytes each rank sent against what averaging the gradients every step sends.
"""

import argparse

import torch
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import mpitrain.torch as hvd
from pytorch_digits import datasets, network


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def local_sgd_bytes(parameter_bytes, steps, warmup_steps, period):
    """Bytes one rank sends in `steps` steps of LocalSGDOptimizer and the
    average_parameters() after them: every gradient in a warm-up step, every
    parameter in an average. Averaging gradients every step sends
    parameter_bytes * steps."""
    warmup = min(steps, warmup_steps)
    return parameter_bytes * (warmup + averages(steps - warmup, period))


def averages(local_steps, period):
    """Averages of the parameters: one every period local steps, one at the end."""
    return local_steps // period + 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--period", type=int, default=4, help="local steps per average")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="for one rank")
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
    warmup_steps = args.warmup_epochs * len(train_batches)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.LocalSGDOptimizer(optimizer, named_parameters=model.named_parameters(),
                                      period=args.period, warmup_steps=warmup_steps)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    progress = tqdm(range(args.epochs), unit="epoch", disable=hvd.rank() != 0)
    for epoch in progress:
        model.train()
        train_sampler.set_epoch(epoch)
        epoch_loss = torch.zeros(())
        for images, labels in train_batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.detach()
        mean_loss = hvd.allreduce(epoch_loss / len(train_batches), name="loss").item()
        progress.set_postfix(loss=f"{mean_loss:.4f}")

    optimizer.average_parameters()             # every rank: identical parameters again
    model.eval()
    correct = torch.zeros(2)                   # right answers, test images
    with torch.no_grad():
        for images, labels in test_batches:
            correct += torch.tensor([(model(images).argmax(1) == labels).sum(), len(labels)])
    right, seen = hvd.allreduce(correct, op=hvd.Sum, name="test.correct").tolist()
    if hvd.rank() == 0:
        steps = args.epochs * len(train_batches)
        parameter_bytes = nbytes(model.parameters())
        sent = local_sgd_bytes(parameter_bytes, steps, warmup_steps, args.period)
        every_step = parameter_bytes * steps
        warmup = min(steps, warmup_steps)
        print(f"{steps} steps: {warmup} synchronous, {steps - warmup} local with "
              f"{averages(steps - warmup, args.period)} averages of the parameters")
        print(f"bytes sent per rank: {sent} against {every_step} averaging the gradients "
              f"every step ({sent / every_step:.3f} of it)")
        print(f"test accuracy: {right / seen:.2f}")


if __name__ == "__main__":
    main()
