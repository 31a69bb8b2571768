"""ShardedOptimizer (ZeRO-1): trains like DistributedOptimizer with 1/N of the state per rank."""

import io
import os
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from mpitrain.api.checkpoint import read_payload
from tests.mpi_harness import mpi_test

torch.set_num_threads(1)

ROWS = 4        # rows per rank


def make_model(layers=2, width=8):
    torch.manual_seed(0)
    shapes = [6] + [width] * (layers - 1) + [3]
    return torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(shapes, shapes[1:])])


def train_step(model, optimizer, step):
    """One step on this rank's rows of the step's batch."""
    generator = torch.Generator().manual_seed(step)
    n, r = hvd.size(), hvd.rank()
    x, y = torch.randn(n * ROWS, 6, generator=generator), torch.randn(n * ROWS, 3,
                                                                      generator=generator)
    optimizer.zero_grad()
    F.mse_loss(model(x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS]).backward()
    optimizer.step()


def assert_same_parameters(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def assert_identical_across_ranks(model):
    mine = [p.detach().numpy().tobytes() for p in model.parameters()]
    assert all(other == mine for other in hvd.allgather_object(mine)), \
        "parameters differ between ranks"


def assert_same_state(state, reference):
    assert state["param_groups"] == reference["param_groups"]
    assert state["state"].keys() == reference["state"].keys()
    for index, values in reference["state"].items():
        assert state["state"][index].keys() == values.keys()
        for key, value in values.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5,
                                       atol=1e-6, msg=f"state of parameter {index}: {key}")


def distributed(model, optimizer_class, **options):
    return hvd.DistributedOptimizer(optimizer_class(model.parameters(), **options),
                                    named_parameters=model.named_parameters())


def state_bytes(optimizer):
    return sum(value.nbytes for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


OPTIMIZERS = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1))]


@mpi_test(np=(2, 3))
def test_trains_like_distributed_optimizer_for_sgd_momentum_and_adamw():
    for optimizer_class, options in OPTIMIZERS:
        model, reference = make_model(3), make_model(3)
        sharded = hvd.ShardedOptimizer(optimizer_class, model.parameters(), **options)
        plain = distributed(reference, optimizer_class, **options)
        for step in range(4):
            train_step(model, sharded, step)
            train_step(reference, plain, step)
            assert_same_parameters(model, reference)
            assert_identical_across_ranks(model)


@mpi_test(np=(2, 3))
def test_step_evaluates_a_closure_once_and_returns_its_loss():
    model, reference = make_model(3), make_model(3)
    sharded = hvd.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    plain = distributed(reference, torch.optim.SGD, lr=0.1)
    x, y = torch.randn(ROWS, 6), torch.randn(ROWS, 3)
    calls = []

    def closure(net, optimizer):
        calls.append(net)
        optimizer.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        return loss

    loss = sharded.step(lambda: closure(model, sharded))
    plain.step(lambda: closure(reference, plain))
    assert calls == [model, reference] and torch.is_tensor(loss)
    assert_same_parameters(model, reference)


class MixedModel(torch.nn.Module):
    """float32 and float64 parameters, and a frozen layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3).double()
        self.frozen = torch.nn.Linear(6, 3).requires_grad_(False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)).double()).float() + self.frozen(x)


@mpi_test(np=(2, 3))
def test_parameters_of_several_dtypes_and_frozen_ones():
    model, reference = MixedModel(), MixedModel()
    sharded = hvd.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    plain = distributed(reference, torch.optim.AdamW, lr=0.01)
    for step in range(3):
        train_step(model, sharded, step)
        train_step(reference, plain, step)
        assert_same_parameters(model, reference)
        assert_identical_across_ranks(model)
    assert_same_state(sharded.full_state_dict(), plain.state_dict())
    assert_same_parameters(model.frozen, MixedModel().frozen)


@mpi_test(np=(2, 3))
def test_each_rank_holds_about_one_nth_of_the_state():
    model, reference = make_model(layers=13, width=32), make_model(layers=13, width=32)
    sharded = hvd.ShardedOptimizer(torch.optim.Adam, model.parameters(), lr=0.01)
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    train_step(model, sharded, 0)
    reference(torch.zeros(1, 6)).sum().backward()
    plain.step()
    everyone = hvd.allgather_object(state_bytes(sharded))
    assert sum(everyone) == state_bytes(plain)
    assert max(everyone) <= 1.1 * state_bytes(plain) / hvd.size(), everyone


@mpi_test(np=(2, 3))
def test_state_dict_is_the_plain_optimizers_and_loads_back():
    model, reference = make_model(3), make_model(3)
    sharded = hvd.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    plain = distributed(reference, torch.optim.AdamW, lr=0.01)
    for step in range(3):
        train_step(model, sharded, step)
        train_step(reference, plain, step)
    state = sharded.full_state_dict()
    assert_same_state(state, plain.state_dict())
    torch.optim.AdamW(make_model(3).parameters()).load_state_dict(state)

    resumed = hvd.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=0.5)
    resumed.load_state_dict(state)
    assert resumed.param_groups[0]["lr"] == 0.01
    for step in range(3, 5):
        train_step(model, resumed, step)
        train_step(reference, plain, step)
        assert_same_parameters(model, reference)


@mpi_test(np=(2, 3))
def test_consolidate_state_dict_gathers_on_one_rank_until_the_next_step():
    model = make_model(3)
    sharded = hvd.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1,
                                   momentum=0.9)
    train_step(model, sharded, 0)
    everywhere = sharded.full_state_dict()
    assert len(everywhere["state"]) == len(list(model.parameters()))
    sharded.consolidate_state_dict(to=1)
    if hvd.rank() == 1:
        assert_same_state(sharded.state_dict(), everywhere)
    else:
        with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=1\) gathered "
                                               r"it on rank 1"):
            sharded.state_dict()
    train_step(model, sharded, 1)
    with pytest.raises(RuntimeError, match="not gathered since the last step"):
        sharded.state_dict()


@mpi_test(np=(2, 3))
def test_parameter_groups_and_an_lr_scheduler_reach_every_shard():
    def groups(model):
        layers = list(model)
        return [{"params": layers[0].parameters(), "lr": 0.1},
                {"params": [p for layer in layers[1:] for p in layer.parameters()],
                 "lr": 0.01, "momentum": 0.5}]

    model, reference = make_model(3), make_model(3)
    sharded = hvd.ShardedOptimizer(torch.optim.SGD, groups(model), momentum=0.9)
    plain = hvd.DistributedOptimizer(torch.optim.SGD(groups(reference), momentum=0.9),
                                     named_parameters=reference.named_parameters())
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
                  for optimizer in (sharded, plain)]
    for step in range(4):
        train_step(model, sharded, step)
        train_step(reference, plain, step)
        for scheduler in schedulers:
            scheduler.step()
        assert_same_parameters(model, reference)
    assert [g["lr"] for g in sharded.param_groups] == [0.1 / 16, 0.01 / 16]


@mpi_test(np=(2, 3))
def test_save_and_load_checkpoint_resume_the_whole_state():
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    path = os.path.join(directory, "checkpoint.pt")
    model = make_model(3)
    sharded = hvd.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    for step in range(2):
        train_step(model, sharded, step)
    hvd.save_checkpoint(path, model, sharded, step=2)
    expected = sharded.full_state_dict()

    resumed_model = make_model(3)
    resumed = hvd.ShardedOptimizer(torch.optim.AdamW, resumed_model.parameters(), lr=0.5)
    assert hvd.load_checkpoint(path, resumed_model, resumed) == {"step": 2}
    assert_same_state(resumed.full_state_dict(), expected)
    if hvd.rank() == 0:
        saved = torch.load(io.BytesIO(read_payload(path)), weights_only=True)
        torch.optim.AdamW(make_model(3).parameters()).load_state_dict(saved["optimizer"])
    for step in range(2, 4):
        train_step(model, sharded, step)
        train_step(resumed_model, resumed, step)
        assert_same_parameters(resumed_model, model)


@mpi_test(np=(2, 3))
def test_ranks_with_different_models_fail_on_every_rank():
    model = make_model(3, width=8 if hvd.rank() == 0 else 9)
    with pytest.raises(ValueError, match=r"ranks \[1.*\] have other parameters than "
                                         r"rank 0 .*shape \(8, 6\).*shape \(9, 6\)"):
        hvd.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)


@mpi_test(np=(2, 3))
def test_an_elastic_torch_state_commits_and_restores_it():
    model = make_model(3)
    sharded = hvd.ShardedOptimizer(torch.optim.Adam, model.parameters(), lr=0.01)
    state = hvd.elastic.TorchState(model, sharded)
    train_step(model, sharded, 0)
    state.commit()
    committed = sharded.full_state_dict()
    parameters = [p.detach().clone() for p in model.parameters()]
    for step in range(1, 3):
        train_step(model, sharded, step)
    state.restore()
    state.sync()
    assert_same_state(sharded.full_state_dict(), committed)
    for p, q in zip(model.parameters(), parameters):
        assert torch.equal(p, q)


@mpi_test(np=(2, 3))
def test_state_dict_on_rank_0_alone_raises_at_once_saying_what_to_call():
    """Horovod's checkpoint pattern, `if hvd.rank() == 0: opt.state_dict()`,
    waited for the stall shutdown: the other ranks never send their shares."""
    model = make_model(3)
    sharded = hvd.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    train_step(model, sharded, 0)
    if hvd.rank() == 0:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"each of the \d ranks holds a share of the "
                                               r"state.*Call optimizer\.consolidate_state"
                                               r"_dict\(to=0\) on every rank first, then "
                                               r"state_dict\(\) on rank 0"):
            sharded.state_dict()
        assert time.monotonic() - started < 1
    sharded.consolidate_state_dict(to=0)
    if hvd.rank() == 0:
        saved = sharded.state_dict()
        assert len(saved["state"]) == len(list(model.parameters()))
    train_step(model, sharded, 1)


@mpi_test(np=(2, 3))
def test_load_state_dict_refuses_a_state_of_other_shapes_on_every_rank():
    other = make_model(3, width=9)
    plain = torch.optim.AdamW(other.parameters(), lr=0.01)
    other(torch.zeros(1, 6)).sum().backward()
    plain.step()
    model = make_model(3)
    sharded = hvd.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(8, 6\), but its state "
                                         r"'exp_avg' in the state to load has shape "
                                         r"\(9, 6\): the state is of another model"):
        sharded.load_state_dict(plain.state_dict())
    train_step(model, sharded, 0)                 # nothing was loaded
    assert_identical_across_ranks(model)


@mpi_test(np=(2, 3))
def test_a_local_update_that_fails_on_its_rank_fails_the_step_on_every_rank():
    """The owner of parameter 0 (stage 1), or of a slice of it (stage 2),
    steps with a moment of a wrong shape (flat and one element short, which
    load_state_dict leaves to the step); the other ranks waited for its
    parameters in the allgather until the stall shutdown."""
    for stage, name in ((1, r"parameters_0of1"), (2, r"parameters\.\d+ \(parameters \d+\.\.")):
        model = make_model(3)
        sharded = hvd.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=0.01,
                                       stage=stage)
        train_step(model, sharded, 0)
        state = sharded.full_state_dict()
        state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].reshape(-1)[1:]
        sharded.load_state_dict(state)
        with pytest.raises(hvd.HorovodInternalError,
                           match=rf"allgather of 'ShardedOptimizer\.{name}.* failed on rank "
                                 r"\d: ShardedOptimizer\.step\(\) raised RuntimeError"):
            train_step(model, sharded, 1)
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.the.failed.step") == \
            hvd.size()


@mpi_test(np=(2, 3))
def test_options_that_differ_between_ranks_fail_on_every_rank():
    """With lr=0 on one rank, the parameters it owns never trained, silently."""
    model = make_model(3)
    lr = 0.0 if hvd.rank() == 1 else 0.1
    with pytest.raises(hvd.MismatchError, match=r"ShardedOptimizer: option 'lr' of "
                                                r"parameter group 0 differs between ranks "
                                                r"\(ranks? [02, ]+: 0\.1; rank 1: 0\.0\)"):
        hvd.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=lr)
    betas = (0.9, 0.99 if hvd.rank() == 1 else 0.999)
    with pytest.raises(hvd.MismatchError, match=r"option 'betas' of parameter group 1 "
                                                r"differs.*rank 1: \(0\.9, 0\.99\)"):
        hvd.ShardedOptimizer(torch.optim.Adam, [
            {"params": model[0].parameters()},
            {"params": model[1].parameters(), "betas": betas}], lr=0.01)
    refused = -1.0 if hvd.rank() == 1 else 0.1     # torch refuses it on rank 1 only
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        hvd.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=refused)
    sharded = hvd.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=0.1)
    train_step(model, sharded, 0)
