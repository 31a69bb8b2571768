"""DistributedOptimizer options that differ between ranks fail every rank when it is built.

Ranks built with another op, other groups or another sparse_as_dense take
other paths through a step, and waited for each other until the stall
shutdown (issue 38, item 5); the short stall shutdown here ends such a wait
in seconds, with its report.
"""

import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test
from tests.test_errors import engine_still_works
from tests.test_torch_optimizer import (ROWS, assert_identical_across_ranks, batch,
                                        make_model, sgd)

STALL_SHUTDOWN = {"MPITRAIN_STALL_CHECK_TIME_SECONDS": "2",
                  "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "5"}


class WithSparseGradient(torch.nn.Module):
    """make_model's layers beside an embedding, whose gradient is sparse."""

    def __init__(self):
        super().__init__()
        self.dense = make_model()
        self.embedding = torch.nn.Embedding(ROWS, 3, sparse=True)

    def forward(self, x):
        return self.dense(x) + self.embedding(torch.arange(len(x)))


def on_rank_1(usual, other):
    return other if hvd.rank() == 1 else usual


def must_agree(option, usual, other):
    """The error every rank gets when rank 1 passed ``other`` and the rest ``usual``."""
    others = "ranks 0, 2" if hvd.size() == 3 else "rank 0"
    return (f"DistributedOptimizer: {option} differs between ranks ({others}: {usual}; "
            f"rank 1: {other}): every rank must use the same")


def fails_at_construction(expected, options, model_factory=make_model):
    """Build a DistributedOptimizer with ``options(model)`` and take a step:
    building it must raise ``expected`` on every rank (a wait ends in the
    stall shutdown's ShutdownError instead)."""
    model = model_factory()
    with pytest.raises((hvd.MismatchError, ValueError)) as caught:
        optimizer = hvd.DistributedOptimizer(
            sgd(model.parameters()),
            **{"named_parameters": model.named_parameters(), **options(model)})
        x, y = batch(hvd.rank(), ROWS)       # what the ranks did without the check
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    assert str(caught.value) == expected, str(caught.value)


@mpi_test(env=STALL_SHUTDOWN)
def test_an_op_that_differs_between_ranks_fails_every_rank_at_construction():
    for usual, other, shown in ((hvd.Average, hvd.Adasum, ("Average", "Adasum")),
                                (hvd.Adasum, hvd.Average, ("Adasum", "Average")),
                                (hvd.Average, hvd.Sum, ("Average", "Sum"))):
        fails_at_construction(must_agree("op", *shown),
                              lambda model: {"op": on_rank_1(usual, other)})
    engine_still_works()


@mpi_test(env=STALL_SHUTDOWN)
def test_groups_that_differ_between_ranks_fail_every_rank_at_construction():
    fails_at_construction(must_agree("groups", None, 2),
                          lambda model: {"groups": on_rank_1(None, 2)})
    fails_at_construction(must_agree("groups", 3, 2),
                          lambda model: {"groups": on_rank_1(3, 2)})
    fails_at_construction(must_agree("groups", None, 2),
                          lambda model: on_rank_1({}, {"num_groups": 2}))
    fails_at_construction(
        must_agree("groups", [["0.weight", "0.bias"]], [["0.weight", "0.bias", "2.bias"]]),
        lambda model: {"groups": [list(model[0].parameters())
                                  + on_rank_1([], [model[2].bias])]})
    engine_still_works()


@mpi_test(env=STALL_SHUTDOWN)
def test_sparse_as_dense_or_predivide_factor_that_differ_fail_every_rank_at_construction():
    for option, usual, other in (("sparse_as_dense", False, True),
                                 ("gradient_predivide_factor", 1.0, 2.0)):
        fails_at_construction(must_agree(option, usual, other),
                              lambda model: {option: on_rank_1(usual, other)},
                              WithSparseGradient)
    engine_still_works()


@mpi_test(env=STALL_SHUTDOWN)
def test_a_parameter_frozen_on_one_rank_only_fails_every_rank_naming_it():
    def frozen_on_rank_1():
        model = make_model()
        model[2].weight.requires_grad_(hvd.rank() != 1)
        return model

    fails_at_construction(
        must_agree("whether '2.weight' is frozen (requires_grad=False)", "no", "yes"),
        lambda model: {}, frozen_on_rank_1)
    engine_still_works()


@mpi_test(env=STALL_SHUTDOWN)
def test_an_option_refused_on_one_rank_only_fails_every_rank_naming_it():
    for refused, why in (
            ({"op": hvd.Sum, "gradient_predivide_factor": 2.0},
             "gradient_predivide_factor is supported only with op=Average, not op=Sum"),
            ({"groups": 0},
             "groups must be a positive number of groups or a list of lists of "
             "parameters, got 0"),
            ({"backward_passes_per_step": 0},
             "backward_passes_per_step must be a whole number >= 1, got 0"),
            ({"named_parameters": [("w", torch.zeros(1)), ("w", torch.zeros(1))]},
             "parameter names in named_parameters must be unique; found duplicates: w")):
        fails_at_construction(on_rank_1(f"DistributedOptimizer failed on rank 1: "
                                        f"ValueError: {why}", why),
                              lambda model: on_rank_1({}, refused))
    engine_still_works()


@mpi_test(env=STALL_SHUTDOWN)
def test_backward_passes_per_step_and_overlap_may_differ_between_ranks():
    """step() sends every gradient the hooks have not sent, so each rank
    sends each gradient once a step whatever these say; a rank that
    accumulates more passes sends their sum, as after no_sync()."""
    r = hvd.rank()
    passes = on_rank_1(1, 2)
    model, alone = make_model(), make_model()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes, overlap=r == 0)
    for step in range(2):
        optimizer.zero_grad()
        alone.zero_grad()
        for part in range(passes):
            x, y = batch(10 * step + 2 * r + part, ROWS)
            F.mse_loss(model(x), y).backward()
            F.mse_loss(alone(x), y).backward()
        everyone = hvd.allgather_object([p.grad for p in alone.parameters()])
        optimizer.step()
        for p, parts in zip(model.parameters(), zip(*everyone)):
            torch.testing.assert_close(p.grad, sum(parts) / hvd.size(), rtol=1e-5,
                                       atol=1e-6)
        with torch.no_grad():
            for p, q in zip(alone.parameters(), model.parameters()):
                p.copy_(q)
    assert_identical_across_ranks(model)
