"""Bad input only mpitrain.torch gets: other kinds of input, optimizer helpers.

tests/test_torch_ops.py and tests/test_torch_optimizer.py cover allreduce's
mismatches, bool tensors, GPU tensors, duplicate names and the optimizer's
argument checks; tests/bad_input_table.py's cases, which every framework
shares, run here on torch. This file covers what only torch has: inputs
that are no CPU tensor, the optimizer helpers, pickled objects, in-place
calls (docs/bad-input.md).
"""

import re
import time

import numpy as np
import pytest
import torch

import mpitrain.torch as hvd
from tests import bad_input_table
from tests.frameworks import Torch
from tests.mpi_harness import mpi_test
from tests.test_torch_ops import raises_everywhere

TORCH = Torch()
engine_still_works = TORCH.engine_still_works

# The shared cases, first in each job (the one before init() wants a fresh process).
globals().update(bad_input_table.tests_for("torch"))


@mpi_test()
def test_tensors_the_core_cannot_take_are_type_errors():
    for value, problem in [([1.0, 2.0], "expected a torch.Tensor, got list"),
                           (np.ones(2), "expected a torch.Tensor, got ndarray"),
                           (torch.ones(2, device="meta"), r"\.cpu\(\)"),
                           (torch.ones(2).to_sparse(), "sparse_allreduce_async")]:
        for label, call in TORCH.every_collective(value, "wrong.kind").items():
            with pytest.raises(TypeError, match=problem):
                call()
    engine_still_works()


@mpi_test()
def test_optimizer_helpers_with_a_root_out_of_range_fail_on_every_rank():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    n = hvd.size()
    for call in (lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=n),
                 lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=n)):
        raises_everywhere(ValueError, "out of range", call)
    engine_still_works()


@mpi_test()
def test_optimizer_helpers_with_models_that_differ_between_ranks():
    r = hvd.rank()
    model = torch.nn.Linear(2, 2).to(torch.float64 if r == 1 else torch.float32)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for _ in range(2):                    # the optimizer is usable after the error
        optimizer.zero_grad()
        model(torch.ones(1, 2, dtype=model.weight.dtype)).sum().backward()
        raises_everywhere(hvd.MismatchError, "data types.*rank 1: float64", optimizer.step)
    # the root's state cannot be loaded where the optimizer holds other parameters
    extra = [torch.nn.Parameter(torch.ones(3))] if r == 1 else []
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))] + extra, lr=0.1)
    raises_everywhere(ValueError, "rank 1: ValueError: .*parameter group",
                      lambda: hvd.broadcast_optimizer_state(other, root_rank=0))
    wider = torch.nn.Linear(2, 2 + (r == 1))
    message = raises_everywhere(hvd.MismatchError, "shapes", lambda: hvd.broadcast_parameters(
        wider.state_dict(), root_rank=0))
    assert "'bias'" in message or "'weight'" in message
    same = torch.nn.Linear(2, 2)            # 'weight' and 'bias' again, right away
    hvd.broadcast_parameters(same.state_dict(), root_rank=0)
    engine_still_works()


@mpi_test()
def test_a_failed_broadcast_parameters_leaves_no_name_in_flight():
    r, n = hvd.rank(), hvd.size()
    # Only rank 1 has a tensor that cannot travel, between two that can.
    params = {"a": torch.full((2,), float(r)),
              "b": torch.zeros(2, dtype=torch.bool if r == 1 else torch.float32),
              "c": torch.full((3,), float(r))}
    raises_everywhere(TypeError, "'b' failed on rank 1: unsupported dtype bool",
                      lambda: hvd.broadcast_parameters(params, root_rank=0))
    again = {"a": torch.full((2,), float(r)), "b": torch.full((2,), float(r)),
             "c": torch.full((3,), float(r))}
    hvd.broadcast_parameters(again, root_rank=n - 1)
    assert all(torch.all(t == n - 1) for t in again.values())
    engine_still_works()


@mpi_test()
def test_a_value_only_one_rank_cannot_broadcast_fails_broadcast_parameters_everywhere():
    r, n = hvd.rank(), hvd.size()
    for odd_one in (3, torch.ones(2).to_sparse()):          # not a dense tensor
        named = {"a": torch.zeros(2), "b": odd_one if r == n - 1 else torch.zeros(2),
                 "c": torch.zeros(3)}
        unnamed = list(named.values())
        for params in (named, unnamed):
            message = raises_everywhere(TypeError, f"failed on rank {n - 1}: ", lambda:
                                        hvd.broadcast_parameters(params, root_rank=0))
            assert ("'b'" in message) == (params is named), message
            assert "expected a torch.Tensor, got int" in message or "layout" in message
    hvd.broadcast_parameters([torch.zeros(2)] * 3, root_rank=0)     # the names still agree
    engine_still_works()


@mpi_test()
def test_an_optimizer_state_the_root_cannot_pickle_fails_every_rank():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if hvd.rank() == 0:                  # only the root pickles the state
        optimizer.param_groups[0]["on_step"] = lambda: None
    raises_everywhere(TypeError, "'broadcast_optimizer_state.size' failed on rank 0: "
                                 "the object cannot be pickled",
                      lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=0))
    engine_still_works()


@mpi_test(init=False)
def test_an_optimizer_used_without_a_running_mpitrain_asks_for_init():
    hvd.shutdown()                      # whatever the test before left running
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"call mpitrain.init\(\)"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    hvd.init()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         overlap=True)
    hvd.shutdown()
    with pytest.raises(ValueError, match=r"call mpitrain.init\(\)"):
        model(torch.ones(1, 2)).sum().backward()     # the hooks submit gradients
    with pytest.raises(ValueError, match=r"call mpitrain.init\(\)"):
        optimizer.step()
    hvd.init()


@mpi_test(np=(3,))
def test_a_parameter_only_some_ranks_have_fails_every_rank_when_the_optimizer_is_built():
    """The optimizer compares its parameters' compressors when it is built
    (docs/compression.md), so a layer only rank 2 has fails there at once; it
    waited for the stall report in the second step."""
    r = hvd.rank()
    layers = [torch.nn.Linear(2, 2)] + ([torch.nn.Linear(2, 2)] if r == 2 else [])
    model = torch.nn.Sequential(*layers)
    raises_everywhere(hvd.MismatchError, re.escape(
        "the compressor of '1.weight' differs between ranks (ranks 0, 1: no such "
        "parameter; rank 2: uncompressed)"), lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters()))
    engine_still_works()


@mpi_test()
def test_a_tensor_only_one_rank_cannot_convert_fails_every_rank_at_once():
    r = hvd.rank()
    for collective in (hvd.allreduce, hvd.allreduce_, hvd.allgather, hvd.reducescatter,
                       lambda t, name: hvd.broadcast_(t, root_rank=0, name=name)):
        name = f"half.complex.{collective.__name__}"
        started = time.monotonic()
        with pytest.raises(TypeError) as caught:   # only rank 0's torch cannot convert it
            collective(torch.zeros(6, dtype=torch.complex32 if r == 0 else torch.float32),
                       name=name)
        assert re.search(rf"'{re.escape(name)}' failed on rank 0: .*unsupported dtype "
                         r"torch\.complex32", str(caught.value)), str(caught.value)
        assert time.monotonic() - started < 10, "the others waited for a stall report"
    engine_still_works()


@mpi_test(init=False)
def test_an_optimizer_whose_backward_failed_can_start_over():
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         overlap=True)
    hvd.shutdown()
    with pytest.raises(ValueError, match="init"):
        model(torch.ones(1, 2)).sum().backward()     # the first hook fails
    hvd.init()
    try:
        optimizer.zero_grad()
    finally:
        engine_still_works()


@mpi_test()
def test_a_grouped_call_with_a_tensor_one_rank_cannot_convert_fails_every_rank():
    r = hvd.rank()
    good = torch.ones(3)
    odd = torch.zeros(3, dtype=torch.complex32) if r == 1 else torch.ones(3)
    started = time.monotonic()
    for call in (hvd.grouped_allreduce, hvd.grouped_allreduce_, hvd.grouped_allgather):
        name = f"grouped.{call.__name__}"
        with pytest.raises(TypeError) as caught:
            call([good, odd], name=name)
        assert re.search(rf"'{re.escape(name)}_0of2'.* failed on rank 1: .*\[1\]: "
                         r"unsupported dtype torch\.complex32",
                         str(caught.value)), str(caught.value)
    assert time.monotonic() - started < 10, "the others waited for a stall report"
    engine_still_works()


@mpi_test()
def test_a_lazily_negated_tensor_is_read_right_and_refused_in_place():
    r, n = hvd.rank(), hvd.size()
    negated = torch._neg_view(torch.full((4,), float(r + 1)))
    assert negated.is_neg()
    got = hvd.allreduce(negated, op=hvd.Sum, name="neg.read")
    assert torch.equal(got, torch.full((4,), -float(sum(range(1, n + 1)))))
    target = negated if r == 1 else torch.ones(4)
    with pytest.raises(TypeError, match="'neg.write' failed on rank 1: allreduce input "
                                        "has its negative bit set"):
        hvd.allreduce_(target, name="neg.write")
    engine_still_works()


class OnlyRankZeroCanLoad:
    """Unpickling fails on every rank but 0, like a module only the root has."""

    def __reduce__(self):
        import importlib
        return (importlib.import_module, ("schedule_of_rank_zero",))


@mpi_test()
def test_objects_some_rank_cannot_unpickle_fail_every_rank_naming_it():
    import sys
    import types
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        sys.modules["schedule_of_rank_zero"] = types.ModuleType("schedule_of_rank_zero")
    started = time.monotonic()
    others = "; ".join(f"on rank {k}, rank 0's object cannot be unpickled here: "
                       "ModuleNotFoundError: No module named 'schedule_of_rank_zero'"
                       for k in range(1, n))
    message = raises_everywhere(TypeError, "broadcast_object of 'schedule' failed: ",
                                lambda: hvd.broadcast_object(OnlyRankZeroCanLoad(), 0,
                                                             name="schedule"))
    assert message.endswith(others), message
    raises_everywhere(TypeError, "allgather_object of 'gathered' failed: on rank 1, rank 0's",
                      lambda: hvd.allgather_object(OnlyRankZeroCanLoad() if r == 0 else r,
                                                   name="gathered"))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.param_groups[0]["schedule"] = OnlyRankZeroCanLoad()
    raises_everywhere(TypeError, "broadcast_object of 'broadcast_optimizer_state' failed",
                      lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=0))
    assert time.monotonic() - started < 10, "the others waited for a stall report"
    engine_still_works()


@mpi_test()
def test_sync_batch_norm_given_a_1d_input_on_one_rank_fails_every_rank():
    r = hvd.rank()
    norm = hvd.SyncBatchNorm(3)
    started = time.monotonic()
    x = torch.randn(3) if r == 1 else torch.randn(4, 3)
    raises_everywhere(ValueError, "failed on rank 1: SyncBatchNorm: expected at least 2D "
                                  r"input \(got 1D input\)", lambda: norm(x))
    assert time.monotonic() - started < 10, "the others waited for a stall report"
    assert norm(torch.randn(4, 3)).shape == (4, 3)
    engine_still_works()


@mpi_test()
def test_one_tensor_twice_in_flight_in_place_is_refused_and_tied_weights_still_broadcast():
    t = torch.ones(3)
    with pytest.raises(ValueError, match="still uses on this rank"):
        hvd.grouped_allreduce_([t, t], name="twice")
    assert torch.equal(t, torch.ones(3))        # neither member ran

    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5))
    model[1].weight = model[0].weight           # tied, as in language models
    torch.manual_seed(hvd.rank())
    torch.nn.init.normal_(model[0].weight)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gathered = hvd.allgather(model[1].weight.detach()[None])
    assert all(torch.equal(gathered[0], g) for g in gathered)
