"""broadcast_parameters, broadcast_optimizer_state, objects and SyncBatchNorm."""

import inspect

import pytest
import torch

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test

torch.set_num_threads(1)


def flattened(value):
    """A structure that compares with ==, tensors turned into (dtype, values)."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {key: flattened(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [flattened(item) for item in value]
    return value


def same_on_every_rank(value):
    everyone = hvd.allgather_object(flattened(value))
    return all(other == everyone[0] for other in everyone)


@mpi_test()
def test_broadcast_parameters_from_state_dict_named_parameters_and_list():
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[1].running_mean.add_(r)
    assert not same_on_every_rank(model.state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=n - 1)
    assert same_on_every_rank(model.state_dict())
    torch.manual_seed(10 + r)
    other = torch.nn.Linear(2, 2)
    hvd.broadcast_parameters(other.named_parameters(), root_rank=0)
    assert same_on_every_rank(other.state_dict())
    assert other.weight.requires_grad
    loose = [torch.full((2,), float(r)), torch.full((1,), -float(r))]
    hvd.broadcast_parameters(loose, root_rank=1)
    assert loose[0].tolist() == [1.0, 1.0] and loose[1].tolist() == [-1.0]


def optimizer_classes():
    return [cls for _, cls in sorted(vars(torch.optim).items())
            if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer]


def model_and_loss(cls, rank):
    torch.manual_seed(rank)
    if cls is torch.optim.SparseAdam:
        embedding = torch.nn.Embedding(5, 3, sparse=True)
        return embedding, lambda: embedding(torch.tensor([0, 2, 2])).pow(2).sum()
    linear = torch.nn.Linear(3, 2, bias=cls is not torch.optim.Muon)  # Muon: 2-D only
    return linear, lambda: linear(torch.ones(4, 3)).pow(2).sum()


@mpi_test(timeout=60)
def test_broadcast_optimizer_state_for_every_torch_optimizer():
    r = hvd.rank()
    classes = optimizer_classes()
    assert len(classes) >= 14
    for cls in classes:
        model, loss_of = model_and_loss(cls, r)
        optimizer = cls(model.parameters(), lr=0.01 * (r + 1))

        def closure():
            optimizer.zero_grad()
            loss = loss_of()
            loss.backward()
            return loss

        if r == 0:                   # only the root has state; the others have none
            optimizer.step(closure)
            optimizer.step(closure)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        assert optimizer.param_groups[0]["lr"] == 0.01, cls.__name__
        assert same_on_every_rank(optimizer.state_dict()), cls.__name__
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer.step(closure)
        assert same_on_every_rank(model.state_dict()), cls.__name__


@mpi_test()
def test_broadcast_optimizer_state_of_a_distributed_optimizer():
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=r + 1.0))
    if r == n - 1:
        optimizer.state[model.weight]["exp_avg"] = torch.ones(2, 3)
        optimizer.state[model.weight]["exp_avg_sq"] = torch.ones(2, 3)
        optimizer.state[model.weight]["step"] = torch.tensor(5.0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=n - 1)
    assert optimizer.param_groups[0]["lr"] == float(n)
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], torch.ones(2, 3))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert same_on_every_rank(model.state_dict())


@mpi_test()
def test_object_collectives_carry_tensors():
    r, n = hvd.rank(), hvd.size()
    got = hvd.broadcast_object({"w": torch.full((2,), float(r))}, root_rank=n - 1)
    assert torch.equal(got["w"], torch.full((2,), n - 1.0))
    gathered = hvd.allgather_object(torch.tensor([r]))
    assert [int(t) for t in gathered] == list(range(n))


@mpi_test()
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch():
    r, n = hvd.rank(), hvd.size()
    for shape_of_rank, reference_class, momentum in [
            (lambda k: (k + 2, 3, 5), torch.nn.BatchNorm1d, 0.1),      # uneven shards
            (lambda k: (2, 4, 3, 2), torch.nn.BatchNorm2d, None),      # cumulative average
            (lambda k: (k + 1, 3), torch.nn.BatchNorm1d, 0.3)]:
        shapes = [shape_of_rank(k) for k in range(n)]
        generator = torch.Generator().manual_seed(7)
        inputs = [3.0 + 2.0 * torch.randn(s, generator=generator) for s in shapes]
        weights = [torch.randn(s, generator=generator) for s in shapes]
        channels = shapes[0][1]
        reference = reference_class(channels, momentum=momentum)
        sync = hvd.SyncBatchNorm(channels, momentum=momentum)
        with torch.no_grad():
            for module in (reference, sync):
                module.weight.copy_(torch.linspace(0.5, 1.5, channels))
                module.bias.copy_(torch.linspace(-1.0, 1.0, channels))
        whole = torch.cat(inputs).requires_grad_()
        expected = reference(whole)
        (expected * torch.cat(weights)).sum().backward()
        mine = inputs[r].clone().requires_grad_()
        output = sync(mine)
        (output * weights[r]).sum().backward()

        start = sum(s[0] for s in shapes[:r])
        rows = slice(start, start + shapes[r][0])
        torch.testing.assert_close(output, expected[rows])
        torch.testing.assert_close(mine.grad, whole.grad[rows])
        torch.testing.assert_close(hvd.allreduce(sync.weight.grad, op=hvd.Sum),
                                   reference.weight.grad)
        torch.testing.assert_close(hvd.allreduce(sync.bias.grad, op=hvd.Sum),
                                   reference.bias.grad)
        torch.testing.assert_close(sync.running_mean, reference.running_mean)
        torch.testing.assert_close(sync.running_var, reference.running_var)
        assert int(sync.num_batches_tracked) == 1
        sync.eval()
        reference.eval()
        torch.testing.assert_close(sync(inputs[r]), reference(inputs[r]))


@mpi_test()
def test_sync_batch_norm_needs_more_than_one_value_per_channel():
    batch = torch.ones(1, 2) if hvd.rank() == 0 else torch.ones(0, 2)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        hvd.SyncBatchNorm(2)(batch)


@mpi_test()
def test_broadcast_optimizer_state_leaves_zero_gradients_as_horovod_does():
    # Horovod's test_broadcast_state_no_grad broadcasts a gradient next.
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert torch.equal(model.weight.grad, torch.zeros(2, 3))
    assert model.bias.grad is None                   # not trainable: left alone
    assert torch.equal(hvd.broadcast(model.weight.grad, root_rank=0), torch.zeros(2, 3))
    embedding = torch.nn.Embedding(4, 2, sparse=True)
    sparse_optimizer = torch.optim.SparseAdam(embedding.parameters())
    hvd.broadcast_optimizer_state(sparse_optimizer, root_rank=0, model=embedding)
    assert embedding.weight.grad.is_sparse          # a sparse step can follow
