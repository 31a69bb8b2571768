"""CUDA tensors through the "mpitrain" torch.distributed backend, on the device path.

The backend converts tensors as the Horovod API does (mpitrain.torch.tensors),
so CUDA tensors take the GPU routes. Here they run where tests/gpu_machine.py
puts GPU tests: on a real GPU, or on the simulated device, whose tensors are
CPU tensors mpitrain takes as device arrays, on each device route. DDP over "mpitrain" on the device ends where DDP
over gloo on the host does, and the collectives match gloo's.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import mpitrain as mt
from tests import gpu_machine as machine
from tests.gpu_report import device_route, expect, expect_route, watch_routes
from tests.mpi_harness import mpi_test
from tests.torch_distributed_groups import gloo_group, mpitrain_group

pytestmark = pytest.mark.gpu


def device():
    watch_routes()
    return machine.torch_device(mt.local_rank())


def ddp_parameters(group, where):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 3)).to(where),
                process_group=group, bucket_cap_mb=0.001)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        generator = torch.Generator().manual_seed(10 * dist.get_rank() + step)
        x, y = torch.randn(8, 12, generator=generator), torch.randn(8, 3, generator=generator)
        optimizer.zero_grad()
        F.mse_loss(model(x.to(where)), y.to(where)).backward()
        optimizer.step()
    return [p.detach().cpu().clone() for p in model.module.parameters()]


@mpi_test(np=(2, 3), envs=machine.ROUTES, skip=machine.runnable, timeout=180)
def test_ddp_and_collectives_on_the_device_match_gloo_on_the_host():
    mpitrain_group()
    where = device()
    with machine.host_reference():
        reference = ddp_parameters(gloo_group(), "cpu")
    ours = ddp_parameters(mpitrain_group(), where)
    for index, (a, b) in enumerate(zip(ours, reference)):
        expect(a, b, f"DDP's parameter {index} after 3 steps", rtol=1e-5, atol=1e-6)
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((5,), float(rank + 1), device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert machine.on_gpu(t)
    expect(t, float(size), "all_reduce MAX")
    gathered = torch.empty(size * 2, device=where)
    mine = torch.full((2,), float(rank), device=where)
    dist.all_gather_into_tensor(gathered, mine)
    expect(gathered, torch.arange(size).repeat_interleave(2).float(),
           "all_gather_into_tensor", inputs=[mine])
    part = torch.empty(2, device=where)
    whole = torch.arange(2 * size, dtype=torch.float32, device=where)
    dist.reduce_scatter_tensor(part, whole)
    expect(part, torch.arange(2 * rank, 2 * rank + 2).float() * size,
           "reduce_scatter_tensor", inputs=[whole])
    if machine.SIMULATION is not None:      # DDP's buckets took the device route
        expect_route("GPU float32 sum", device_route())
