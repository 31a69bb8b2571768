"""hvd.elastic for PyTorch in a fixed MPI world: commit, restore, sync, retry."""

import copy

import pytest
import torch

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test

torch.set_num_threads(1)
STEPS = 12


def make_training():
    torch.manual_seed(hvd.rank())                   # sync() must even this out
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 2))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters())
    return model, optimizer


def one_step(model, optimizer, step):
    batch = torch.Generator().manual_seed(100 * step + hvd.rank())
    inputs, targets = torch.randn(8, 4, generator=batch), torch.randn(8, 2, generator=batch)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()


def trained_straight_through(model):
    """The same steps without elastic, from the state rank 0 starts with."""
    reference = copy.deepcopy(model)
    hvd.broadcast_parameters(reference.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
        named_parameters=reference.named_parameters())
    for step in range(STEPS):
        one_step(reference, optimizer, step)
        optimizer.step()
    return reference


@mpi_test()
def test_a_recoverable_error_on_one_rank_resumes_every_rank_from_the_last_commit():
    model, optimizer = make_training()
    expected = trained_straight_through(model)
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    resumed_at, failed = [], []
    state.register_reset_callbacks([lambda: resumed_at.append(state.step)])

    @hvd.elastic.run
    def train(state):
        while state.step < STEPS:
            one_step(state.model, state.optimizer, state.step)
            if state.step == 7 and hvd.rank() == hvd.size() - 1 and not failed:
                failed.append(state.step)
                raise hvd.HorovodInternalError("lost a batch (raised on purpose)")
            state.optimizer.step()
            state.step += 1
            if state.step % 5 == 0:
                state.commit()
        return "finished"

    assert train(state) == "finished"
    assert resumed_at == [5]                        # every rank went back to step 5
    for got, want in zip(model.state_dict().values(), expected.state_dict().values()):
        assert torch.equal(got, want)


@mpi_test()
def test_errors_that_retrying_cannot_fix_leave_run_at_once():
    state = hvd.elastic.TorchState(epoch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(1)])

    @hvd.elastic.run
    def train(state):
        hvd.allreduce(torch.ones(2 + hvd.rank()), name="uneven")

    with pytest.raises(hvd.MismatchError):
        train(state)
    assert resets == []
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum)[0] == hvd.size()


@mpi_test(env={"MPITRAIN_ELASTIC_RESET_LIMIT": "2"})
def test_an_error_that_keeps_coming_back_gives_up_after_the_reset_limit():
    state = hvd.elastic.TorchState(attempts=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(1)])

    @hvd.elastic.run
    def train(state):
        hvd.allreduce(torch.ones(1), name="before")
        if hvd.rank() == 0:
            raise hvd.HorovodInternalError("this batch always fails")
        hvd.allreduce(torch.ones(1), name="after")

    if hvd.rank() == 0:
        with pytest.raises(hvd.HorovodInternalError, match="always fails"):
            train(state)
    else:
        with pytest.raises(hvd.ShutdownError, match="gave up after 2 resets.*always fails"):
            train(state)
    assert len(resets) == 2
    hvd.init()


@mpi_test()
def test_the_elastic_sampler_skips_what_was_processed_before_the_reset():
    sampler = hvd.elastic.ElasticSampler(list(range(30)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    trained, failed = [], []                   # trained: this rank's samples

    @hvd.elastic.run
    def one_epoch(state):
        indices = list(iter(state.sampler))
        for batch_idx in range((len(indices) + 1) // 2):
            batch = state.sampler.get_indices(batch_idx, 2)
            if batch_idx == 2 and hvd.rank() == hvd.size() - 1 and not failed:
                failed.append(batch_idx)
                raise hvd.HorovodInternalError("preempted (raised on purpose)")
            hvd.allreduce(torch.ones(1), name="train.step")
            trained.extend(batch)
            state.sampler.record_batch(batch_idx, 2)
            state.commit()                     # nothing trained goes uncommitted

    one_epoch(state)
    everyone = sorted(i for mine in hvd.allgather_object(trained) for i in mine)
    assert everyone == list(range(30)), everyone           # each sample exactly once
