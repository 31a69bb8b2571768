"""DDP over the "mpitrain" backend ends where DDP over gloo does.

Each case trains two copies of one model side by side, one wrapped in DDP
over "mpitrain", one over gloo, on rank-dependent batches, and compares the
parameters after several steps, which also agree bitwise between the ranks.
On 2 ranks they are bitwise those of gloo: both backends add two gradients,
and a + b is b + a. On 3 ranks gloo's ring adds each chunk's three gradients
starting at a different rank, and mpitrain's order depends on how its engine
fused the tensors, and floating-point addition is not associative, so the
last bits may differ: there the parameters agree to float32 rounding, and
the gradients of the first step equal the true mean to the same tolerance.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.mpi_harness import mpi_test
from tests.torch_distributed_groups import gloo_group, mpitrain_group

torch.set_num_threads(1)
STEPS = 4


class Net(torch.nn.Module):
    """Three layers, the last unused where ``unused`` (find_unused_parameters)."""

    def __init__(self, unused=False):
        super().__init__()
        self.first = torch.nn.Linear(12, 32)
        self.second = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 4)
        self.unused_head = torch.nn.Linear(16, 4)
        self.unused = unused

    def forward(self, x):
        hidden = torch.tanh(self.second(torch.tanh(self.first(x))))
        out = self.head(hidden)
        return out if self.unused else out + self.unused_head(hidden)


def batch(step):
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(8, 12, generator=generator), torch.randn(8, 4, generator=generator)


def train(group, hook=None, unused=False, bucket_cap_mb=0.002, **options):
    """Parameters after STEPS steps of DDP over ``group`` (small buckets: several
    allreduces a step)."""
    torch.manual_seed(0)
    model = DDP(Net(unused), process_group=group, bucket_cap_mb=bucket_cap_mb,
                find_unused_parameters=unused, **options)
    if hook is not None:
        model.register_comm_hook(*hook(group))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.module.parameters()]


def assert_same_training(tolerance=1e-6, **case):
    ours, gloos = train(mpitrain_group(), **case), train(gloo_group(), **case)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ours, group=gloo_group())
    assert all(torch.equal(a, b) for other in everyone for a, b in zip(ours, other)), \
        "the ranks' replicas differ"
    for name, a, b in zip(dict(Net().named_parameters()), ours, gloos):
        if dist.get_world_size() == 2:
            assert torch.equal(a, b), f"{name} differs from DDP over gloo: {(a - b).abs().max()}"
        else:
            worst = ((a - b).abs() / (1 + b.abs())).max()
            assert worst <= tolerance, f"{name} differs from DDP over gloo by {worst}"


def fp16(group):
    return group, default_hooks.fp16_compress_hook


def power_sgd(group):
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2, min_compression_rate=0.5,
                                        use_error_feedback=True, random_seed=0)
    return state, powerSGD_hook.powerSGD_hook


CASES = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "unused_parameters": {"unused": True},
    # gradients travel in float16 (its rounding is 2**-11 of a value)
    "fp16_compress_hook": {"hook": fp16, "tolerance": 1e-3},
    # One bucket: with more, gloo's two threads now and then both wait inside
    # PowerSGD's callbacks, and gloo hangs (test_torch_distributed.py has calls
    # from callbacks made while the user's thread makes others)
    "powerSGD_hook": {"hook": power_sgd, "bucket_cap_mb": 25},
}


@mpi_test(np=(2, 3), timeout=180, over=tuple(CASES))
def test_ddp_over_mpitrain_ends_with_the_parameters_of_ddp_over_gloo(case):
    assert dist.get_backend(mpitrain_group()) == "mpitrain"
    assert_same_training(**CASES[case])


@mpi_test(np=(2, 3), timeout=180)
def test_ddp_gradients_are_the_mean_of_the_ranks_gradients():
    """The gradients DDP leaves after one backward pass, against the mean of each
    rank's own gradients (computed without DDP, gathered with gloo)."""
    torch.manual_seed(0)
    alone = Net()
    x, y = batch(0)
    F.mse_loss(alone(x), y).backward()
    size = dist.get_world_size()
    everyone = [p.grad.new_zeros((size * p.shape[0],) + p.shape[1:])
                for p in alone.parameters()]
    for gathered, p in zip(everyone, alone.parameters()):
        dist.all_gather_into_tensor(gathered, p.grad, group=gloo_group())
    torch.manual_seed(0)
    model = DDP(Net(), process_group=mpitrain_group(), bucket_cap_mb=0.002)
    F.mse_loss(model(x), y).backward()
    for gathered, p in zip(everyone, model.module.parameters()):
        mean = gathered.view(size, *p.shape).mean(0)
        torch.testing.assert_close(p.grad, mean, rtol=1e-5, atol=1e-7)
