"""DistributedOptimizer: N ranks on shards train like one process on the whole batch."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test

torch.set_num_threads(1)

ROWS = 4        # rows per rank and backward pass


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(step, rows):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(rows, 6, generator=generator), torch.randn(rows, 3, generator=generator)


def assert_identical_across_ranks(model):
    mine = [p.detach().numpy().tobytes() for p in model.parameters()]
    assert all(other == mine for other in hvd.allgather_object(mine)), \
        "parameters differ between ranks"


def assert_close(model, reference, atol=1e-6):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=atol, msg=name)


def local_gradients(model, loss):
    """The gradients this rank alone computes, on a copy without hooks (zeros for none)."""
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
             for p in model.parameters()]
    model.zero_grad()
    return grads


def check_against_one_process(make_optimizer, steps=4, passes=1, atol=1e-6,
                              set_to_none=True, after_step=None, make_reference=None,
                              model_factory=make_model, **options):
    """Train on this rank's shard and check each step against one process
    on the whole batch; returns the model and the optimizer."""
    r, n = hvd.rank(), hvd.size()
    reference, model = model_factory(), model_factory()
    reference_optimizer = (make_reference or make_optimizer)(reference.parameters())
    optimizer = hvd.DistributedOptimizer(make_optimizer(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes, **options)
    for step in range(steps):
        x, y = batch(step, n * passes * ROWS)
        reference_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()

        optimizer.zero_grad(set_to_none=set_to_none)
        mine = slice(r * passes * ROWS, (r + 1) * passes * ROWS)
        for part in torch.arange(passes * ROWS).split(ROWS):
            (F.mse_loss(model(x[mine][part]), y[mine][part]) / passes).backward()
        optimizer.step()
        assert_close(model, reference, atol)
        assert_identical_across_ranks(model)
        if after_step is not None:
            after_step(step, model, reference)
    return model, optimizer


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


@mpi_test()
def test_sgd_with_momentum_matches_one_process_on_the_whole_batch():
    check_against_one_process(sgd)


@mpi_test()
def test_adam_matches_one_process_on_the_whole_batch():
    check_against_one_process(adam, atol=1e-5)


@mpi_test()
def test_two_backward_passes_per_step_accumulate_locally():
    check_against_one_process(sgd, passes=2)


@mpi_test()
def test_groups_by_count_and_by_list():
    check_against_one_process(adam, atol=1e-5, groups=2)
    model = make_model()
    first = list(model[0].parameters())
    check_against_one_process(sgd, groups=[first])     # new model: these are foreign
    check_against_one_process(sgd, num_groups=3)


@mpi_test()
def test_compressed_gradients_stay_close():
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        check_against_one_process(sgd, steps=2, atol=2e-2, compression=compression)


@mpi_test()
def test_sum_and_predivide_factor():
    n = hvd.size()
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         op=hvd.Sum)
    copy = make_model()
    x, y = batch(hvd.rank(), ROWS)
    grads = local_gradients(copy, F.mse_loss(copy(x), y))
    F.mse_loss(model(x), y).backward()
    optimizer.synchronize()
    everyone = hvd.allgather_object(grads)
    for p, parts in zip(model.parameters(), zip(*everyone)):
        torch.testing.assert_close(p.grad, sum(parts), rtol=1e-5, atol=1e-6)
    with optimizer.skip_synchronize():
        optimizer.step()
    check_against_one_process(sgd, gradient_predivide_factor=float(n))
    with pytest.raises(ValueError, match="only with op=Average"):
        hvd.DistributedOptimizer(sgd(make_model().parameters()), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)


def two_heads():
    """A body and two heads, of which each rank's loss uses one (see loss_of)."""
    torch.manual_seed(1)
    return torch.nn.ModuleDict({"body": torch.nn.Linear(4, 4),
                                "a": torch.nn.Linear(4, 1), "b": torch.nn.Linear(4, 1)})


def loss_of(net, x):
    head = net["a"] if hvd.rank() == 0 else net["b"]     # rank 0 never touches head b
    return head(net["body"](x)).pow(2).mean()


@mpi_test()
def test_parameters_without_gradient_on_some_ranks_get_zeros_instead_of_a_hang():
    r = hvd.rank()

    model, copy = two_heads(), two_heads()
    x = batch(r, ROWS)[0][:, :4]
    grads = local_gradients(copy, loss_of(copy, x))
    everyone = hvd.allgather_object(grads)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    loss_of(model, x).backward()
    optimizer.step()
    for (name, p), parts in zip(model.named_parameters(), zip(*everyone)):
        torch.testing.assert_close(p.grad, sum(parts) / hvd.size(), rtol=1e-5, atol=1e-7,
                                   msg=name)
    assert_identical_across_ranks(model)


@mpi_test()
def test_gradscaler_and_clipping_recipe_with_skip_synchronize():
    """synchronize(), unscale_, clip, then step inside skip_synchronize()."""
    r, n = hvd.rank(), hvd.size()
    reference, model = make_model(), make_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                         named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for step in range(3):
        x, y = batch(step, n * ROWS)
        reference_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
        reference_optimizer.step()

        optimizer.zero_grad()
        mine = slice(r * ROWS, (r + 1) * ROWS)
        scaler.scale(F.mse_loss(model(x[mine]), y[mine])).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
        scaler.update()
        assert_close(model, reference)
    # An overflow on one rank reaches every rank: all skip the step together.
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    loss = F.mse_loss(model(x[:ROWS]), y[:ROWS]) * (float("inf") if r == 0 else 1.0)
    scaler.scale(loss).backward()
    optimizer.synchronize()
    scaler.unscale_(optimizer)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert hvd.allgather_object(scaler.get_scale()) == [2.0 ** 11] * n


@mpi_test()
def test_step_after_synchronize_warns_and_still_steps():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()))
    F.mse_loss(model(batch(0, ROWS)[0]), batch(0, ROWS)[1]).backward()
    optimizer.synchronize()
    with pytest.warns(UserWarning, match="without optimizer.skip_synchronize"):
        optimizer.step()
    assert_identical_across_ranks(model)


@mpi_test()
def test_zero_grad_with_gradients_in_flight_is_an_error():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         backward_passes_per_step=2)
    x, y = batch(0, ROWS)
    F.mse_loss(model(x), y).backward()              # accumulated, not yet sent
    with pytest.raises(AssertionError, match="zero_grad"):
        optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()              # sent now
    with pytest.raises(AssertionError, match="zero_grad"):
        optimizer.zero_grad()
    optimizer.step()
    assert_identical_across_ranks(model)
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    F.mse_loss(model(x), y).backward()
    F.mse_loss(model(x), y).backward()
    # As in Horovod, the error comes after autograd added this pass into p.grad.
    with pytest.raises(AssertionError, match="more than backward_passes_per_step=2"):
        F.mse_loss(model(x), y).backward()
    optimizer.step()                                # what was in flight completes
    optimizer.zero_grad()


@mpi_test()
def test_wrapping_keeps_the_class_and_checks_names():
    model = make_model()
    adam_optimizer = adam(model.parameters())
    optimizer = hvd.DistributedOptimizer(adam_optimizer,
                                         named_parameters=model.named_parameters())
    assert isinstance(optimizer, torch.optim.Adam) and type(optimizer).__name__ == "Adam"
    assert optimizer.param_groups is adam_optimizer.param_groups
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique.*0.weight"):
        hvd.DistributedOptimizer(sgd(model.parameters()),
                                 named_parameters=named + [("0.weight", named[0][1])])
    with pytest.raises(ValueError, match="does not name every parameter"):
        hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=named[:2])
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(optimizer)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(sgd(model.parameters()), op=hvd.Adasum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="before wrapping"):
        optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@mpi_test()
def test_a_parameter_shaped_differently_on_one_rank_fails_every_rank():
    r = hvd.rank()
    model = torch.nn.Linear(3, 2 + (r > 0))
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=[("head.weight", model.weight),
                                                           ("head.bias", model.bias)])
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(hvd.MismatchError, match="mismatch") as caught:
        optimizer.step()
    assert "'head.weight'" in str(caught.value) or "'head.bias'" in str(caught.value)
    with pytest.raises(hvd.MismatchError):    # not "already in flight": none is left
        optimizer.synchronize()
    optimizer.zero_grad()


def embedding_loss(embedding, ids):
    return embedding(ids).pow(2).sum() / ids.numel()


def sparse_steps_beside_one_process(model, reference, loss, ids, steps, sparse,
                                    **options):
    """Take steps of SGD on model through DistributedOptimizer (this rank's
    row of ids) and on reference alone (every row), checking after each
    synchronize() that the parameter ``sparse`` got a sparse gradient; yields
    after every step."""
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                         **options)
    for _ in range(steps):
        reference_optimizer.zero_grad()
        loss(reference, ids).backward()
        reference_optimizer.step()
        optimizer.zero_grad()
        loss(model, ids[hvd.rank()]).backward()
        optimizer.synchronize()
        assert sparse.grad.is_sparse
        with optimizer.skip_synchronize():
            optimizer.step()
        yield


@mpi_test()
def test_sparse_gradients_gathered_or_as_dense():
    n = hvd.size()
    ids = torch.arange(n * 3).remainder(7).view(n, 3)
    for sparse_as_dense in (False, True):
        torch.manual_seed(2)
        reference = torch.nn.Embedding(7, 2, sparse=True)
        model = torch.nn.Embedding(7, 2, sparse=True)
        model.load_state_dict(reference.state_dict())
        for _ in sparse_steps_beside_one_process(model, reference, embedding_loss, ids,
                                                 2, model.weight,
                                                 sparse_as_dense=sparse_as_dense):
            torch.testing.assert_close(model.weight, reference.weight)
            assert_identical_across_ranks(model)


@mpi_test(np=(3,))
def test_a_process_set_averages_among_its_members_only():
    r = hvd.rank()
    pair = hvd.add_process_set([0, 1])
    try:
        model = make_model()
        optimizer = hvd.DistributedOptimizer(sgd(model.parameters()), process_set=pair)
        x, y = batch(r, ROWS)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        alone = make_model()
        F.mse_loss(alone(x), y).backward()
        sgd(alone.parameters()).step()
        params = hvd.allgather_object([p.detach() for p in model.parameters()])
        assert all(torch.equal(p, q) for p, q in zip(params[0], params[1]))
        assert not torch.equal(params[0][0], params[2][0])
        if r == 2:
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), alone.parameters()))
    finally:
        hvd.remove_process_set(pair)


@mpi_test()
def test_overlap_sends_during_backward_and_without_it_step_sends_everything():
    results = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = make_model()
        optimizer = hvd.DistributedOptimizer(
            sgd(model.parameters()), overlap=overlap,
            named_parameters=[(f"{overlap}.{n}", p) for n, p in model.named_parameters()])
        for step in range(3):
            optimizer.zero_grad()
            x, y = batch(step, ROWS)
            F.mse_loss(model(x), y).backward()
            assert bool(optimizer._pending) == overlap     # in flight before step()
            optimizer.step()
        assert_identical_across_ranks(model)
        results[overlap] = [p.detach().clone() for p in model.parameters()]
    for with_overlap, without in zip(results[True], results[False]):
        assert torch.equal(with_overlap, without)


@mpi_test(np=(1,), env={"MPITRAIN_TEST_ONE_RANK_PIPELINE": "1"})
def test_the_one_rank_pipeline_setting_sends_a_lone_ranks_gradients_through_the_engine():
    """What lets a one-GPU machine run DistributedOptimizer's device pipeline
    (issue 27): with the setting, a rank alone negotiates and moves its
    gradients, here rounded to fp16 on the wire, instead of skipping."""
    import mpitrain as mt
    controller = mt.api.basics.engine().controllers[0]
    negotiations = controller.negotiations
    model, plain = make_model(), make_model()
    optimizer = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16)
    plain_optimizer = sgd(plain.parameters())
    for net, opt in ((model, optimizer), (plain, plain_optimizer)):
        opt.zero_grad()
        x, y = batch(0, ROWS)
        F.mse_loss(net(x), y).backward()
        if opt is optimizer:
            opt.synchronize()
            with opt.skip_synchronize():
                exact = [p.grad.clone() for p in net.parameters()]
                opt.step()
        else:
            opt.step()
    assert controller.negotiations > negotiations
    wire = [g.half().float() for g in (p.grad for p in plain.parameters())]
    assert all(torch.equal(g, w) for g, w in zip(exact, wire)), "not rounded to fp16"
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                    plain.parameters()))


@mpi_test(np=(1, 2))
def test_a_rank_alone_in_its_set_steps_like_the_plain_optimizer_and_sends_nothing():
    import mpitrain as mt
    alone = (hvd.global_process_set if hvd.size() == 1
             else hvd.add_process_set([hvd.size() - 1]))
    try:
        controller = mt.api.basics.engine().controllers[0]
        negotiations = controller.negotiations
        if alone.included():
            model, plain = make_model(), make_model()
            optimizer = hvd.DistributedOptimizer(
                sgd(model.parameters()), named_parameters=model.named_parameters(),
                compression=hvd.Compression.fp16, backward_passes_per_step=2,
                process_set=alone)
            plain_optimizer = sgd(plain.parameters())
            for step in range(3):
                for net, opt in ((model, optimizer), (plain, plain_optimizer)):
                    opt.zero_grad()
                    for part in range(2):
                        x, y = batch(2 * step + part, ROWS)
                        (F.mse_loss(net(x), y) / 2).backward()
                    opt.step()
            # fp16 on the wire would have rounded the gradients: nothing travelled.
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(),
                                                        plain.parameters()))
            with pytest.raises(AssertionError, match="backward_passes_per_step=2"):
                for _ in range(3):
                    F.mse_loss(model(x), y).backward()
        assert controller.negotiations == negotiations
    finally:
        hvd.barrier()
        if alone is not hvd.global_process_set:
            hvd.remove_process_set(alone)


class FailsInBackward(torch.autograd.Function):
    """The identity, whose backward raises when told to (a bad batch, an OOM)."""

    fail = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if FailsInBackward.fail:
            raise RuntimeError("bad batch")
        return grad


@mpi_test()
def test_a_backward_that_failed_on_one_rank_is_dropped_on_every_rank_and_training_goes_on():
    """Rank 1's backward raises after the last layer's gradient went out; the
    ranks agree to skip that batch, drop the step, and train on as if the
    batch had never been."""
    r, n = hvd.rank(), hvd.size()
    reference, model = make_model(), make_model()
    reference_optimizer = sgd(reference.parameters())
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         overlap=True)
    mine = slice(r * ROWS, (r + 1) * ROWS)
    for step in range(3):
        x, y = batch(step, n * ROWS)
        optimizer.zero_grad()
        FailsInBackward.fail = step == 1 and r == 1
        failed = 0
        try:
            hidden = FailsInBackward.apply(model[1](model[0](x[mine])))
            F.mse_loss(model[2](hidden), y[mine]).backward()
        except RuntimeError:
            failed = 1
            with pytest.raises(AssertionError, match=r"optimizer\.drop_step\(\)"):
                optimizer.zero_grad()              # the message says what to call
        if hvd.allreduce(torch.tensor(failed), op=hvd.Max, name=f"failed.{step}"):
            optimizer.drop_step()
            assert all(p.grad is None for p in model.parameters())
            continue
        optimizer.step()
        reference_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
    assert_close(model, reference)
    assert_identical_across_ranks(model)
