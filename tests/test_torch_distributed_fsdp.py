"""FSDP2 (fully_shard), DTensor and distributed checkpoints over the "mpitrain" backend.

FSDP2 over "mpitrain" ends where FSDP2 over gloo does (bitwise on 2 ranks,
to float32 rounding on 3, as in test_torch_distributed_ddp.py) and where one
process training on every rank's batch does; each rank holds its 1/N of the
parameters, gradients and Adam state. A checkpoint that torch's DCP saves
from 2 ranks loads on 3, resharded, and the reverse.
"""

import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from tests.mpi_harness import mpi_test
from tests.torch_distributed_groups import gloo_group, mpitrain_group

torch.set_num_threads(1)


def transformer():
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
              for _ in range(2)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 4))


def batch(step, rank):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(2, 5, 16, generator=generator), torch.randn(2, 5, 4, generator=generator)


def sharded(group):
    model = transformer()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model[:2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model, optimizer, steps, rank, first=0):
    for step in range(first, first + steps):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()


def full(model):
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@mpi_test(np=(2, 3), timeout=180)
def test_fully_shard_equals_gloo_and_one_process_on_every_batch():
    mpitrain_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    ours, gloos = sharded(mpitrain_group()), sharded(gloo_group())
    for model in (ours, gloos):
        train(model, sgd(model), 3, rank)
    alone = transformer()          # one process, every rank's rows: the mean loss
    optimizer = sgd(alone)
    for step in range(3):
        xs, ys = zip(*(batch(step, r) for r in range(size)))
        optimizer.zero_grad()
        F.mse_loss(alone(torch.cat(xs)), torch.cat(ys)).backward()
        optimizer.step()
    ours, gloos = full(ours), full(gloos)
    for name, p in alone.named_parameters():
        if size == 2:
            assert torch.equal(ours[name], gloos[name]), name
        else:
            torch.testing.assert_close(ours[name], gloos[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[name], p.detach(), rtol=1e-4, atol=1e-5)


@mpi_test(np=(2, 3), timeout=180)
def test_each_rank_holds_its_share_of_parameters_gradients_and_adam_state():
    mpitrain_group()
    size = dist.get_world_size()
    model = sharded(mpitrain_group())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train(model, optimizer, 1, dist.get_rank())
    total = sum(p.numel() for p in model.parameters())
    shares = {"parameters": [p.to_local() for p in model.parameters()],
              "gradients": [p.grad.to_local() for p in model.parameters()],
              "exp_avg": [optimizer.state[p]["exp_avg"].to_local() for p in model.parameters()],
              "exp_avg_sq": [optimizer.state[p]["exp_avg_sq"].to_local()
                             for p in model.parameters()]}
    for what, tensors in shares.items():
        mine = sum(t.numel() for t in tensors)
        # fully_shard splits each parameter's first dimension, the last rank's part smaller
        most = sum(math.ceil(p.shape[0] / size) * p[0].numel() for p in model.parameters())
        assert mine <= most, (what, mine, most)
        everyone = torch.tensor([mine])
        dist.all_reduce(everyone)
        assert everyone.item() == total, (what, everyone.item(), total)


def shared_directory():
    path = [tempfile.mkdtemp(prefix="mpitrain-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def adam_state(model, optimizer):
    return {name: {key: value.full_tensor() for key, value in optimizer.state[p].items()
                   if key != "step"} for name, p in model.named_parameters()}


def save(model, optimizer, path, group):
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path,
             process_group=group)
    return full(model), adam_state(model, optimizer)


def load(model, optimizer, path, group):
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return full(model), adam_state(model, optimizer)


def assert_restored(saved, loaded):
    for name in saved[0]:
        assert torch.equal(saved[0][name], loaded[0][name]), name
        for key in saved[1][name]:
            assert torch.equal(saved[1][name][key], loaded[1][name][key]), (name, key)


@mpi_test(np=(3,), timeout=180)
def test_a_checkpoint_saved_on_two_ranks_loads_on_three_and_the_reverse():
    mpitrain_group()
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    path = shared_directory()
    try:
        saved = None
        if rank < 2:
            model = sharded(pair)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            train(model, optimizer, 2, rank)
            saved = save(model, optimizer, os.path.join(path, "two"), pair)
        dist.barrier()
        saved = [saved]
        dist.broadcast_object_list(saved, src=0)
        model = sharded(mpitrain_group())
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        assert_restored(saved[0], load(model, optimizer, os.path.join(path, "two"), None))
        train(model, optimizer, 1, rank, first=2)
        saved = save(model, optimizer, os.path.join(path, "three"), None)
        if rank < 2:
            model = sharded(pair)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            assert_restored(saved, load(model, optimizer, os.path.join(path, "three"), pair))
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
