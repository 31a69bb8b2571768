"""DiLoCoOptimizer: H inner steps per rank, then an outer step on the mean pseudo-gradient.

The references are mpitrain's DistributedOptimizer and LocalSGDOptimizer
(DiLoCo's special cases) and, for everything else, every rank's training
replayed in this one process with torch's own optimizers (``replay``): the
inner steps, the true mean of the pseudo-gradients, and torch's SGD with
Nesterov momentum (or the outer optimizer chosen) applied to it.
"""

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test
from tests.test_torch_optimizer import ROWS, assert_identical_across_ranks, batch, make_model

torch.set_num_threads(1)


def loss_on(model, rank, step):
    """The loss of ``rank``'s own rows at ``step`` (they differ between ranks)."""
    x, y = batch(100 * rank + step, ROWS)
    return F.mse_loss(model(x), y)


def train(model, optimizer, steps, first=0):
    for step in range(first, first + steps):
        optimizer.zero_grad()
        loss_on(model, hvd.rank(), step).backward()
        optimizer.step()


def nesterov(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def replay(steps, inner, outer, inner_steps, fragments=((0, 1, 2, 3),), overlap=0,
           mixing=0.0, workers=None):
    """Every worker's parameters after each of ``steps`` DiLoCo steps, with
    torch's optimizers in this process: [step][worker] -> parameters.

    workers: the ranks of each worker, whose gradients are averaged every
    inner step (default: each rank a worker). fragments: the indices of the
    parameters synced together, the f-th landing after (f + 1) * H // F
    inner steps (mod H) and leaving ``overlap`` steps before.
    """
    workers = workers or [[rank] for rank in range(hvd.size())]
    models = [make_model() for _ in workers]
    inners = [inner(model.parameters()) for model in models]
    global_model = make_model()
    globals_ = list(global_model.parameters())
    outer_optimizer = outer(globals_)
    lands = [(f + 1) * inner_steps // len(fragments) for f in range(len(fragments))]
    history, in_flight = [], None
    for step in range(1, steps + 1):
        for model, optimizer, ranks in zip(models, inners, workers):
            optimizer.zero_grad()
            for rank in ranks:
                (loss_on(model, rank, step - 1) / len(ranks)).backward()
            optimizer.step()
        phase = step % inner_steps
        for f, indices in enumerate(fragments):
            if (lands[f] - overlap) % inner_steps == phase:
                in_flight = f, {i: sum(globals_[i].detach() - list(model.parameters())[i].detach()
                                       for model in models) / len(models) for i in indices}
            if lands[f] % inner_steps == phase:
                landing, means = in_flight
                assert landing == f
                outer_optimizer.zero_grad(set_to_none=True)
                for i in indices:
                    globals_[i].grad = means[i]
                outer_optimizer.step()
                for model in models:
                    for i in indices:
                        local = list(model.parameters())[i]
                        local.data = (1 - mixing) * globals_[i].detach() + mixing * local.detach()
        history.append([[p.detach().clone() for p in model.parameters()] for model in models])
    return history


def assert_parameters(model, expected, atol=1e-6, what=""):
    for (name, p), q in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=atol, msg=f"{what} {name}")


def diloco(model, inner=None, **options):
    inner = inner or torch.optim.SGD(model.parameters(), lr=0.1)
    return hvd.DiLoCoOptimizer(inner, named_parameters=model.named_parameters(), **options)


@mpi_test()
def test_one_inner_step_and_outer_sgd_of_lr_1_give_distributed_optimizers_parameters():
    model, synchronous = make_model(), make_model()
    optimizer = diloco(model, inner_steps=1,
                       outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    reference = hvd.DistributedOptimizer(torch.optim.SGD(synchronous.parameters(), lr=0.1),
                                         named_parameters=synchronous.named_parameters())
    for step in range(4):
        train(model, optimizer, 1, step)
        train(synchronous, reference, 1, step)
        assert_parameters(model, list(synchronous.parameters()), what=f"step {step}")
        assert_identical_across_ranks(model)
    assert optimizer.exchanges == 4


@mpi_test()
def test_outer_sgd_of_lr_1_without_momentum_gives_local_sgds_parameters():
    model, local = make_model(), make_model()
    optimizer = diloco(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       inner_steps=3, outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    reference = hvd.LocalSGDOptimizer(
        torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9),
        named_parameters=local.named_parameters(), period=3, overlap_averaging=False)
    for step in range(7):
        train(model, optimizer, 1, step)
        train(local, reference, 1, step)
        assert_parameters(model, list(local.parameters()), what=f"step {step}")
    assert optimizer.exchanges == 2


@mpi_test()
def test_outer_step_is_torchs_nesterov_sgd_on_the_mean_pseudo_gradient():
    """The paper's recipe: AdamW inside, SGD(lr 0.7, momentum 0.9, Nesterov)
    outside (the default), through two outer steps."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=0.01)

    model = make_model()
    optimizer = diloco(model, adamw(model.parameters()), inner_steps=3)
    assert isinstance(optimizer, torch.optim.AdamW)
    outer = optimizer.outer_optimizer.param_groups[0]
    assert (outer["lr"], outer["momentum"], outer["nesterov"]) == (0.7, 0.9, True)
    expected = replay(6, adamw, nesterov, inner_steps=3)
    for step in range(6):
        train(model, optimizer, 1, step)
        assert_parameters(model, expected[step][hvd.rank()], what=f"step {step}")
        if step % 3 == 2:
            assert_identical_across_ranks(model)
    optimizer.synchronize_parameters()
    assert_identical_across_ranks(model)


@mpi_test()
def test_streaming_fragments_leave_and_land_at_their_steps_with_mixing():
    """H=4, 2 fragments (contiguous, about equal in size: [0.weight] of 48
    elements, then [0.bias, 2.weight, 2.bias] of 35), each leaving one step
    before it lands: fragment 0 lands
    after steps 2, 6, fragment 1 after 4, 8; the local parameters then hold
    half the new global fragment and half their own."""
    model = make_model()
    optimizer = diloco(model, inner_steps=4, fragments=2, overlap_steps=1)
    expected = replay(8, lambda params: torch.optim.SGD(params, lr=0.1), nesterov,
                      inner_steps=4, fragments=((0,), (1, 2, 3)), overlap=1, mixing=0.5)
    exchanges = []
    for step in range(8):
        train(model, optimizer, 1, step)
        exchanges.append(optimizer.exchanges)
        assert_parameters(model, expected[step][hvd.rank()], what=f"step {step + 1}")
    assert exchanges == [1, 1, 2, 2, 3, 3, 4, 4]      # leaving after steps 1, 3, 5, 7
    sizes = [p.numel() * 4 for p in model.parameters()]
    assert optimizer.bytes_sent == 2 * sum(sizes)


@mpi_test()
def test_pseudo_gradients_travel_through_the_compression():
    """fp16 and int8 (with error feedback) pseudo-gradients stay close to the
    exact outer step and send 1/2 and about 1/3 of the bytes (the biases
    travel uncompressed)."""
    def wide():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 256), torch.nn.Tanh(),
                                   torch.nn.Linear(256, 3))

    results = {}
    for name, compression in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16),
                              ("int8", hvd.Compression.int8(min_elements=0))):
        model = wide()
        optimizer = hvd.DiLoCoOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        inner_steps=2, compression=compression)
        train(model, optimizer, 4)
        results[name] = ([p.detach().clone() for p in model.parameters()],
                         optimizer.bytes_sent)
        assert_identical_across_ranks(model)
    exact, full = results["none"]
    for name, ratio, atol in (("fp16", 0.5, 1e-3), ("int8", 0.35, 5e-3)):
        params, sent = results[name]
        for p, q in zip(params, exact):
            torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=name)
        assert sent <= ratio * full, (name, sent, full)
    assert results["int8"][0][0].ne(exact[0]).any()


@mpi_test()
def test_state_dict_and_elastic_state_bring_back_the_global_copy_outer_state_and_step():
    """Saved after step 5 of H=4, F=2, overlap 1 (fragment 0 in flight):
    the rest of the training is the same after loading, in a new optimizer
    too, and after an elastic state's restore."""
    def build(model):
        return diloco(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      inner_steps=4, fragments=2, overlap_steps=1)

    model = make_model()
    optimizer = build(model)
    train(model, optimizer, 5)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    assert saved[1]["diloco"]["inner_steps_taken"] == 5
    assert saved[1]["diloco"]["landed"]["fragment"] == 0
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer)
    state.save()
    train(model, optimizer, 7, first=5)       # fragment 1 lands in the last step
    after = [p.detach().clone() for p in model.parameters()]

    fresh = make_model()
    fresh.load_state_dict(saved[0])
    resumed = build(fresh)
    resumed.load_state_dict(saved[1])
    train(fresh, resumed, 7, first=5)
    for p, q in zip(fresh.parameters(), after):
        assert torch.equal(p, q)

    state.restore()
    train(model, optimizer, 7, first=5)
    for p, q in zip(model.parameters(), after):
        assert torch.equal(p, q)


@mpi_test(np=(4,), timeout=60)
def test_gradients_averaged_inside_a_node_and_diloco_across_nodes():
    """Ranks 0, 1 and 2, 3 are two nodes averaging gradients every step
    (DistributedOptimizer over the node's set); DiLoCo runs across them over
    the sets {0, 2} and {1, 3}: two workers of two ranks each."""
    r = hvd.rank()
    nodes = [hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])]
    across = [hvd.add_process_set([0, 2]), hvd.add_process_set([1, 3])]
    try:
        model = make_model()
        inner = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         process_set=nodes[r // 2])
        optimizer = hvd.DiLoCoOptimizer(inner, named_parameters=model.named_parameters(),
                                        inner_steps=3, process_set=across[r % 2])
        expected = replay(6, lambda params: torch.optim.SGD(params, lr=0.1), nesterov,
                          inner_steps=3, workers=[[0, 1], [2, 3]])
        for step in range(6):
            train(model, optimizer, 1, step)
            assert_parameters(model, expected[step][r // 2], what=f"step {step + 1}")
        everyone = hvd.allgather_object([p.detach() for p in model.parameters()])
        assert all(torch.equal(p, q) for p, q in zip(everyone[0], everyone[1]))
        assert all(torch.equal(p, q) for p, q in zip(everyone[0], everyone[3]))
    finally:
        for process_set in nodes + across:
            hvd.remove_process_set(process_set)


@mpi_test()
def test_bad_options_are_refused_on_every_rank():
    model = make_model()
    for options, message in (
            ({"inner_steps": 0}, "inner_steps must be"),
            ({"inner_steps": 2, "fragments": 3}, "fragments cannot each sync once"),
            ({"fragments": [model[0], [model[2].weight]]}, "fragments leave out 2.bias"),
            ({"fragments": [model[0], model[0], model[2]]}, "fragments hold a parameter twice"),
            ({"inner_steps": 4, "fragments": 2, "overlap_steps": 2}, "overlap_steps must be"),
            ({"mixing": 1.5}, "mixing must be"),
            ({"outer_optimizer": torch.optim.SGD(make_model().parameters(), lr=1)},
             "outer_optimizer must be built over the parameters")):
        with pytest.raises(ValueError, match=message):
            diloco(model, **options)
    local = hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not a LocalSGDOptimizer"):
        hvd.DiLoCoOptimizer(local)


@mpi_test()
def test_options_that_differ_between_ranks_fail_every_rank_at_construction():
    """Ranks with their own H or fragments sent different fragments at
    different steps and the last exchange waited for the stall shutdown."""
    r = hvd.rank()
    others = "ranks 0, 2" if hvd.size() == 3 else "rank 0"
    for option, usual, other in (("inner_steps", 4, 2), ("fragments", 1, 2),
                                 ("overlap_steps", 0, 1)):
        with pytest.raises(hvd.MismatchError, match=re.escape(
                f"DiLoCoOptimizer: {option} differs between ranks ({others}: {usual}; "
                f"rank 1: {other}): every rank must use the same")):
            diloco(make_model(), **{"inner_steps": 4, option: other if r == 1 else usual})
    with pytest.raises(ValueError) as caught:
        diloco(make_model(), inner_steps=0 if r == 1 else 4)
    assert str(caught.value).startswith(
        "inner_steps must be" if r == 1 else
        "DiLoCoOptimizer failed on rank 1: ValueError: inner_steps must be")


@mpi_test(np=(4,), timeout=60)
def test_a_process_set_averages_among_its_members_only():
    """Ranks 0 and 1 run DiLoCo together; ranks 2 and 3, outside the set,
    step the plain inner optimizer."""
    r = hvd.rank()
    pair = hvd.add_process_set([0, 1])
    try:
        model = make_model()
        optimizer = diloco(model, inner_steps=2, process_set=pair)
        train(model, optimizer, 4)
        if r < 2:
            expected = replay(4, lambda params: torch.optim.SGD(params, lr=0.1), nesterov,
                              inner_steps=2, workers=[[0], [1]])[-1][r]
        else:
            alone = make_model()
            train(alone, torch.optim.SGD(alone.parameters(), lr=0.1), 4)
            expected = list(alone.parameters())
        assert_parameters(model, expected)
        assert optimizer.exchanges == (2 if r < 2 else 0)
    finally:
        hvd.remove_process_set(pair)
