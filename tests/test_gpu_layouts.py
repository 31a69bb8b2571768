"""tests/test_layouts.py on CUDA tensors: every layout, and a channels_last conv net.

The bodies are the CPU tests' own, so the two devices are held to the same
references: numpy on every rank's values, an mpi4py allgather of every
rank's gradients (CPU copies), torch's BatchNorm2d and
DistributedDataParallel (over gloo, which takes CUDA tensors and lets ranks
share a GPU). On a GPU machine they run on its GPUs; elsewhere on the
simulated device, on each route (tests/gpu_machine.py). A failure names the
device, the transport, the tensor's shape, dtype, strides and storage
offset, and its first wrong values.
"""

import pytest

from tests import gpu_machine as machine
from tests import test_layouts as layouts
from tests.mpi_harness import mpi_test
from tests.test_gpu import torch_device

pytestmark = pytest.mark.gpu
ROUTES = machine.ROUTES
ALONE = {route: dict(env, **layouts.ALONE) for route, env in ROUTES.items()}


@mpi_test(np=(1, 2, 3), timeout=120, envs=ROUTES, skip=machine.runnable)
def test_every_collective_fused_on_every_layout_on_cuda():
    layouts.every_collective_on_every_layout(torch_device())


@mpi_test(np=(1, 2, 3), timeout=120, envs=ALONE, skip=machine.runnable)
def test_every_collective_alone_on_every_layout_on_cuda():
    layouts.every_collective_on_every_layout(torch_device())


@mpi_test(np=(1, 2, 3), timeout=120, envs=ROUTES, skip=machine.runnable)
def test_expanded_cuda_tensors_are_refused_as_in_place_outputs_on_every_rank():
    layouts.expanded_in_place_outputs_are_refused_everywhere(torch_device())


@mpi_test(np=(2, 3), timeout=120, envs=ROUTES, skip=machine.runnable)
def test_ranks_holding_one_cuda_tensor_in_two_layouts_average_it_in_place():
    layouts.one_tensor_in_two_layouts_averaged_in_place(torch_device())


@mpi_test(np=(1, 2, 3), timeout=120, envs=ROUTES, skip=machine.runnable)
def test_distributed_optimizer_fused_on_a_channels_last_conv_net_on_cuda():
    layouts.conv_net_gradients_are_the_true_mean(torch_device(), steps=4)


@mpi_test(np=(1, 2, 3), timeout=120, envs=ALONE, skip=machine.runnable)
def test_distributed_optimizer_alone_on_a_channels_last_conv_net_on_cuda():
    layouts.conv_net_gradients_are_the_true_mean(torch_device(), steps=4)


@mpi_test(np=(1, 2, 3), timeout=120, envs=ROUTES, skip=machine.runnable)
def test_sync_batch_norm_on_channels_last_cuda_inputs():
    layouts.sync_batch_norm_on_channels_last(torch_device())
