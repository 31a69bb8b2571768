"""Handwritten digits with PyTorch on every rank, through mpitrain.torch.

    .venv/bin/mpitrainrun -np 2 python examples/pytorch_digits.py

scikit-learn ships the data (1797 images of 8x8 pixels), so nothing is
downloaded. Each rank trains on its own shard of the training images;
DistributedOptimizer averages the gradients, so every rank holds the same
weights. The test images are split across the ranks too, and the correct
answers are summed over all of them.
"""

import argparse

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import mpitrain.torch as hvd


def datasets():
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=0.25, random_state=0, stratify=labels)
    return TensorDataset(train_x, train_y), TensorDataset(test_x, test_y)


def network():
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="for one rank")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(hvd.rank())          # the broadcast below makes the weights equal
    torch.set_num_threads(1)
    train, test = datasets()
    # drop_last: every rank gets the same number of batches, so none waits for
    # a partner that has run out of data.
    train_sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(),
                                       drop_last=True)
    train_batches = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler)
    test_shard = Subset(test, range(hvd.rank(), len(test), hvd.size()))
    test_batches = DataLoader(test_shard, batch_size=256)

    model = network()
    # The global batch grows with the ranks; so does the learning rate.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters())
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

    model.eval()
    correct = torch.zeros(2)                   # right answers, test images
    with torch.no_grad():
        for images, labels in test_batches:
            correct += torch.tensor([(model(images).argmax(1) == labels).sum(), len(labels)])
    right, seen = hvd.allreduce(correct, op=hvd.Sum, name="test.correct").tolist()
    if hvd.rank() == 0:
        print(f"test accuracy: {right / seen:.2f}")


if __name__ == "__main__":
    main()
