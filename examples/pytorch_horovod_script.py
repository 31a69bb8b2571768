"""A PyTorch training script written for Horovod, running on mpitrain with
nothing changed but the import line.

    .venv/bin/mpitrainrun -np 2 python examples/pytorch_horovod_script.py

It follows the recipe Horovod's documentation teaches: pin a GPU by local
rank when there is one, shard the data with DistributedSampler, scale the
learning rate with the number of ranks (not for Adasum), broadcast the
initial weights and optimizer state from rank 0, wrap the optimizer (with
optional fp16 compression, Adasum and gradient predivision), print from
rank 0 only, and average the test metrics with named allreduces. The data
are scikit-learn's bundled digits, so nothing is downloaded.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import mpitrain.torch as hvd             # was: import horovod.torch as hvd


def arguments():
    parser = argparse.ArgumentParser(description="digits classifier, data-parallel")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="for one rank")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=10, help="batches")
    parser.add_argument("--no-cuda", action="store_true")
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--use-adasum", action="store_true")
    parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    return parser.parse_args()


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout = nn.Dropout(0.25)
        self.hidden = nn.Linear(32 * 2 * 2, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(F.relu(self.hidden(x.flatten(1))))
        return F.log_softmax(self.out(x), dim=1)


def digits(seed):
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1350], order[1350:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def averaged(value, name):
    """The mean of a number over all ranks."""
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def main():
    args = arguments()
    use_cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.manual_seed(args.seed)
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
    torch.set_num_threads(1)              # one rank per core: no thread fights
    device = "cuda" if use_cuda else "cpu"

    train_set, test_set = digits(args.seed)
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=100, sampler=test_sampler)

    model = ConvNet().to(device)
    # Adasum adapts the step itself; plain averaging wants a larger rate.
    lr_scale = 1 if args.use_adasum else hvd.size()
    if use_cuda and args.use_adasum and hvd.nccl_built():
        lr_scale = hvd.local_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scale,
                                momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch, (images, labels) in enumerate(train_loader):
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(images), labels)
            loss.backward()
            optimizer.step()
            if batch % args.log_every == 0 and hvd.rank() == 0:
                print(f"epoch {epoch} [{batch * len(images)}/{len(train_sampler)} "
                      f"on rank 0] loss {loss.item():.4f}")

        model.eval()
        total_loss = correct = 0.0
        with torch.no_grad():
            for images, labels in test_loader:
                images, labels = images.to(device), labels.to(device)
                log_probabilities = model(images)
                total_loss += F.nll_loss(log_probabilities, labels, reduction="sum").item()
                correct += (log_probabilities.argmax(1) == labels).sum().item()
        test_loss = averaged(total_loss / len(test_sampler), "avg_loss")
        accuracy = averaged(correct / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: test loss {test_loss:.4f}, "
                  f"test accuracy {100 * accuracy:.1f}%")


if __name__ == "__main__":
    main()
