"""Every collective and DistributedOptimizer on every tensor layout torch makes.

channels_last and channels_last_3d, transposed, sliced with a storage offset,
a view inside a larger buffer, and stride-0 expanded tensors (inputs only: as
an in-place output one is refused on every rank), in float32 and the 16-bit
types, fused and alone, in place and out of place; and a channels_last conv
net trained with DistributedOptimizer. The references are nobody's code here:
numpy on every rank's values, an mpi4py allgather of every rank's gradients,
torch's BatchNorm2d and DistributedDataParallel. The bodies take a device:
tests/test_gpu_layouts.py runs them on CUDA, where tensors reach the core
through the same conversion (mpitrain.torch.tensors.as_array).
"""

import copy
import os
import tempfile
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpitrain as mt
import mpitrain.torch as hvd
from devtools import simulated_cupy
from devtools.simulated_cupy import torch_seam
from mpitrain.engine.execution import fusion
from mpitrain.transport import selection
from tests.mpi_harness import mpi_test

torch.set_num_threads(1)

ALONE = {"MPITRAIN_FUSION_THRESHOLD": "0"}      # every tensor reduced by itself
OUTSIDE = 999.0          # what a larger buffer holds around the view under test


def contiguous(values, device):
    return values.to(device)


def channels_last(values, device):
    return values.to(device, memory_format=torch.channels_last)


def channels_last_3d(values, device):
    return values.to(device, memory_format=torch.channels_last_3d)


def transposed(values, device):
    return values.t().contiguous().to(device).t()


def sliced(values, device):
    """Every other row and some columns of a larger tensor: an offset and two strides."""
    rows, columns = values.shape
    larger = torch.full((2 * rows + 1, columns + 3), OUTSIDE, dtype=values.dtype,
                        device=device)
    view = larger[1::2, 2:2 + columns]
    view.copy_(values)
    return view


def inside_a_larger_buffer(values, device):
    """A contiguous view that starts inside a larger flat buffer."""
    larger = torch.full((values.numel() + 10,), OUTSIDE, dtype=values.dtype,
                        device=device)
    view = larger[3:3 + values.numel()].view(values.shape)
    view.copy_(values)
    return view


def expanded(values, device):
    """The first column repeated by a stride of 0: readable, not writable."""
    return values[:, :1].to(device).expand(values.shape)


# (label, shape, dtype, make): the 288 KiB one is fused into a buffer large
# enough for the shared-memory route, which takes only contiguous arrays.
LAYOUTS = [
    ("contiguous", (6, 5), torch.float32, contiguous),
    ("channels_last", (2, 3, 4, 5), torch.float32, channels_last),
    ("channels_last 288 KiB", (4, 64, 16, 18), torch.float32, channels_last),
    ("channels_last_3d", (2, 3, 2, 3, 4), torch.float32, channels_last_3d),
    ("transposed", (5, 7), torch.float32, transposed),
    ("sliced", (4, 6), torch.float32, sliced),
    ("inside a larger buffer", (3, 5), torch.float32, inside_a_larger_buffer),
    ("expanded", (4, 6), torch.float32, expanded),
    ("channels_last float16", (2, 3, 2, 4), torch.float16, channels_last),
    ("channels_last bfloat16", (2, 3, 2, 4), torch.bfloat16, channels_last),
]


def rank_values(shape, dtype, rank):
    """Small integers, every 16-bit type holds them; they differ by element and rank."""
    count = int(np.prod(shape))
    return ((torch.arange(count) * 7 + 5 * rank) % 23 - 11).reshape(shape).to(dtype)


def transport(device):
    """How this job's tensors on ``device`` travel, for failure messages."""
    settings = ", ".join(f"{key}={value}" for key, value in sorted(os.environ.items())
                         if key.startswith("MPITRAIN_"))
    if device.type == "cpu" and not torch_seam.enabled():
        where = "host memory"
    else:
        engine = mt.api.basics.engine()
        where = (f"{simulated_cupy.describe()}: "
                 f"{selection.describe(engine.device_plan, engine.cuda_aware)}")
    return f"{where}; ranks: {mt.size()}; {settings or 'default settings'}"


# torch.testing.assert_close's own tolerances: a rounding of the result's type.
TOLERANCES = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def check(got, want, what, layout=None):
    """got equals want within got's rounding; a failure says what a reader needs
    without a rerun: the transport, the layout of the tensor, the first wrong values."""
    layout = got if layout is None else layout
    actual = got.detach().cpu()
    expected = want.detach().cpu().to(actual.dtype)
    rtol, atol = TOLERANCES.get(actual.dtype, (1.3e-6, 1e-5))
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as failure:
        close = torch.isclose(actual.double(), expected.double(), rtol=rtol, atol=atol)
        wrong = (~close).nonzero()[:5].tolist()
        raise AssertionError(
            f"{what}: on {transport(layout.device)}; tensor of shape "
            f"{tuple(layout.shape)}, {layout.dtype}, strides {layout.stride()}, "
            f"storage offset {layout.storage_offset()}, on {layout.device}; first "
            f"wrong values at {wrong}: got {[actual[tuple(i)].item() for i in wrong]}, "
            f"want {[expected[tuple(i)].item() for i in wrong]}\n{failure}") from None


def inputs_of_every_rank(make, shape, dtype):
    """What each rank's tensor holds, read as a user would (contiguous, on the CPU)."""
    return [make(rank_values(shape, dtype, k), "cpu").contiguous()
            for k in range(mt.size())]


def mean(tensors):
    return (sum(t.double() for t in tensors) / len(tensors)).float()


def rows_of(rank, count, size):
    """The rows reducescatter and even alltoall splits give ``rank``: low ranks get
    any extra row."""
    share, extra = divmod(count, size)
    start = rank * share + min(rank, extra)
    return slice(start, start + share + (rank < extra))


def check_in_place(tensor, before, want, what):
    """The result is in the tensor itself, in its own layout, and nowhere else."""
    stride, pointer = before
    check(tensor, want, what)
    assert (tensor.stride(), tensor.data_ptr()) == (stride, pointer), (
        f"{what}: the tensor moved or changed layout: strides {stride} -> "
        f"{tensor.stride()}")
    base = tensor if tensor._base is None else tensor._base
    around = (base == OUTSIDE).sum().item()
    assert around == base.numel() - tensor.numel(), (
        f"{what}: {base.numel() - tensor.numel() - around} elements around the view "
        "were written")


def every_collective_on_every_layout(device):
    """Each collective out of place on every layout, submitted together so that
    they fuse (unless the job says otherwise); then the in-place forms."""
    device = torch.device(device)
    r, n = mt.rank(), mt.size()
    everyone = {label: inputs_of_every_rank(make, shape, dtype)
                for label, shape, dtype, make in LAYOUTS}
    mine = {label: make(rank_values(shape, dtype, r), device)
            for label, shape, dtype, make in LAYOUTS}
    writable = [label for label in mine if label != "expanded"]

    handles = {label: hvd.allreduce_async(t, name=f"mean.{label}")
               for label, t in mine.items()}
    for label, handle in handles.items():
        check(hvd.synchronize(handle), mean(everyone[label]), f"allreduce of {label}",
              mine[label])
        check(mine[label], everyone[label][r], f"allreduce's input {label} afterwards")
    grouped = hvd.grouped_allreduce(list(mine.values()), name="grouped")
    for label, result in zip(mine, grouped):
        check(result, mean(everyone[label]), f"grouped_allreduce of {label}", mine[label])
    pending = []
    for label, t in mine.items():
        rows = t.shape[0]
        splits = torch.tensor([len(range(rows)[rows_of(k, rows, n)]) for k in range(n)])
        pending += [
            ("allgather", label, hvd.allgather_async(t, name=f"gather.{label}"),
             torch.cat(everyone[label])),
            ("broadcast", label, hvd.broadcast_async(t, n - 1, name=f"bcast.{label}"),
             everyone[label][n - 1]),
            ("alltoall", label, hvd.alltoall_async(t, splits, name=f"a2a.{label}"),
             torch.cat([e[rows_of(r, rows, n)] for e in everyone[label]])),
            ("reducescatter", label, hvd.reducescatter_async(t, name=f"scatter.{label}"),
             mean(everyone[label])[rows_of(r, rows, n)])]
    for kind, label, handle, want in pending:
        result = hvd.synchronize(handle)
        check(result[0] if kind == "alltoall" else result, want, f"{kind} of {label}",
              mine[label])

    for form in ("allreduce_", "grouped_allreduce_", "broadcast_"):
        tensors = {label: make(rank_values(shape, dtype, r), device)
                   for label, shape, dtype, make in LAYOUTS if label in writable}
        before = {label: (t.stride(), t.data_ptr()) for label, t in tensors.items()}
        if form == "allreduce_":
            for handle in [hvd.allreduce_async_(t, name=f"in_place.{label}")
                           for label, t in tensors.items()]:
                hvd.synchronize(handle)
        elif form == "grouped_allreduce_":
            hvd.grouped_allreduce_(list(tensors.values()), name="grouped_in_place")
        else:
            for handle in [hvd.broadcast_async_(t, n - 1, name=f"bcast_.{label}")
                           for label, t in tensors.items()]:
                hvd.synchronize(handle)
        for label, t in tensors.items():
            want = (everyone[label][n - 1] if form == "broadcast_"
                    else mean(everyone[label]))
            check_in_place(t, before[label], want, f"{form} of {label}")


def expanded_in_place_outputs_are_refused_everywhere(device):
    """A stride-0 tensor as an in-place output: a ValueError on every rank naming
    the operation and the strides, and the engine goes on."""
    _, shape, dtype, make = next(entry for entry in LAYOUTS if entry[0] == "expanded")
    n = mt.size()
    calls = {
        "allreduce_": lambda t: hvd.allreduce_(t, name="refused.allreduce_"),
        "grouped_allreduce_": lambda t: hvd.grouped_allreduce_(
            [torch.ones(3, device=device), t], name="refused.grouped"),
        "broadcast_": lambda t: hvd.broadcast_(t, n - 1, name="refused.broadcast_"),
    }
    for form, call in calls.items():
        tensor = make(rank_values(shape, dtype, mt.rank()), device)
        with pytest.raises(ValueError) as raised:
            call(tensor)
        message = str(raised.value)
        assert "refused." in message and "share memory" in message, (form, message)
        assert f"strides {tuple(s * tensor.element_size() for s in tensor.stride())}" \
            in message, message
    check(hvd.allreduce(torch.ones(2, device=device), op=hvd.Sum, name="still.works"),
          torch.full((2,), float(n)), "an allreduce after the refusals")


def one_tensor_in_two_layouts_averaged_in_place(device):
    """channels_last on odd ranks, contiguous on even ones: elements are matched by
    index, not by where they lie. 1 MiB, so the engine reduces it alone."""
    shape, r = (4, 64, 32, 32), mt.rank()
    everyone = inputs_of_every_rank(contiguous, shape, torch.float32)
    tensor = (channels_last if r % 2 else contiguous)(
        rank_values(shape, torch.float32, r), device)
    before = (tensor.stride(), tensor.data_ptr())
    hvd.allreduce_(tensor, name="two.layouts")
    check_in_place(tensor, before, mean(everyone),
                   "allreduce_ of one tensor in two layouts")


@mpi_test(np=(2, 3), timeout=120)
def test_every_collective_fused_on_every_layout():
    every_collective_on_every_layout("cpu")


@mpi_test(np=(2, 3), timeout=120, env=ALONE)
def test_every_collective_alone_on_every_layout():
    every_collective_on_every_layout("cpu")


@mpi_test(np=(2, 3), timeout=120)
def test_expanded_tensors_are_refused_as_in_place_outputs_on_every_rank():
    expanded_in_place_outputs_are_refused_everywhere("cpu")


@mpi_test(np=(2, 3), timeout=120)
def test_ranks_holding_one_tensor_in_two_layouts_average_it_in_place():
    one_tensor_in_two_layouts_averaged_in_place("cpu")


# -- DistributedOptimizer, SyncBatchNorm --------------------------------------------

def conv_net(device):
    """The issue's two convolutions, a third whose weight the engine reduces alone
    (590 KiB), pooling and a Linear; in channels_last."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                        nn.Conv2d(64, 256, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(256, 10))
    return net.to(device, memory_format=torch.channels_last)


def batch(device, step):
    generator = torch.Generator().manual_seed(100 * step + mt.rank())
    images = torch.randn(4, 3, 10, 10, generator=generator)
    labels = torch.randint(10, (4,), generator=generator)
    return images.to(device, memory_format=torch.channels_last), labels.to(device)


def torch_distributed(world):
    """torch.distributed over gloo, once per job: DDP is a reference."""
    if not dist.is_initialized():
        name = f"mpitrain-ddp-{uuid.uuid4()}" if world.rank == 0 else None
        store = os.path.join(tempfile.gettempdir(), world.bcast(name))
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=world.rank,
                                world_size=world.size)


def loss_of(net, images, labels):
    return nn.functional.cross_entropy(net(images), labels)


def conv_net_gradients_are_the_true_mean(device, steps=3):
    """DistributedOptimizer's gradients after synchronize() against the mean of every
    rank's own gradients (an mpi4py allgather), and its parameters after the steps
    against DDP's."""
    device = torch.device(device)
    # On a GPU, TF32 would round convolutions to 10 bits of mantissa and the model
    # and DDP's copy drift apart by rounding alone: in float32 only a wrong
    # average shows.
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    world = MPI.COMM_WORLD.Dup()
    torch_distributed(world)
    model = conv_net(device)
    big = model[4].weight
    assert big.numel() * big.element_size() >= fusion.ALONE_BYTES
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters())
    for step in range(steps):
        images, labels = batch(device, step)
        alone = copy.deepcopy(model)          # this rank's own gradients
        loss_of(alone, images, labels).backward()
        everyone = world.allgather([p.grad.cpu() for p in alone.parameters()])
        optimizer.zero_grad()
        loss_of(model, images, labels).backward()
        optimizer.synchronize()
        for index, (name, p) in enumerate(model.named_parameters()):
            check(p.grad, mean([grads[index] for grads in everyone]),
                  f"averaged gradient of '{name}' after synchronize(), step {step}")
            assert p.grad.stride() == p.stride(), (
                f"'{name}': the gradient's strides {p.grad.stride()} are not its "
                f"parameter's {p.stride()} at step {step}")
        with optimizer.skip_synchronize():
            optimizer.step()
        ddp_optimizer.zero_grad()
        loss_of(ddp, images, labels).backward()
        ddp_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
        check(p, q, f"parameter '{name}' after {steps} steps, against DDP's")
    world.Free()


def sync_batch_norm_on_channels_last(device):
    """SyncBatchNorm of channels_last inputs against BatchNorm2d on every rank's batch."""
    device = torch.device(device)
    r, n = mt.rank(), mt.size()
    generator = torch.Generator().manual_seed(5)
    batches = [3.0 + 2.0 * torch.randn(k + 2, 4, 3, 5, generator=generator)
               for k in range(n)]
    weights = [torch.randn(b.shape, generator=generator) for b in batches]
    reference = nn.BatchNorm2d(4)
    whole = torch.cat(batches).requires_grad_()
    expected = reference(whole)
    (expected * torch.cat(weights)).sum().backward()
    norm = hvd.SyncBatchNorm(4).to(device)
    mine = batches[r].to(device, memory_format=torch.channels_last).requires_grad_()
    output = norm(mine)
    (output * weights[r].to(device)).sum().backward()
    rows = slice(sum(len(b) for b in batches[:r]), sum(len(b) for b in batches[:r + 1]))
    check(output, expected[rows], "SyncBatchNorm's output", mine)
    check(mine.grad, whole.grad[rows], "SyncBatchNorm's input gradient", mine)
    check(norm.running_mean, reference.running_mean, "SyncBatchNorm's running mean")
    check(norm.running_var, reference.running_var, "SyncBatchNorm's running variance")


@mpi_test(np=(2, 3), timeout=120)
def test_distributed_optimizer_fused_on_a_channels_last_conv_net():
    conv_net_gradients_are_the_true_mean("cpu")


@mpi_test(np=(2, 3), timeout=120, env=ALONE)
def test_distributed_optimizer_alone_on_a_channels_last_conv_net():
    conv_net_gradients_are_the_true_mean("cpu")


@mpi_test(np=(2, 3), timeout=120)
def test_sync_batch_norm_on_channels_last_inputs():
    sync_batch_norm_on_channels_last("cpu")
