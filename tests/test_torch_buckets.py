"""DistributedOptimizer's gradient buckets: small gradients live in flat
tensors that are reduced whole, in place, and training still matches one
process on the whole batch."""

import json
import os
import shutil
import tempfile

import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from mpitrain.engine.execution import fusion
from mpitrain.torch.optimizers import buckets
from tests.mpi_harness import mpi_test
from tests.test_torch_optimizer import (ROWS, adam, assert_close,
                                        assert_identical_across_ranks, batch,
                                        check_against_one_process, embedding_loss,
                                        loss_of, sgd, sparse_steps_beside_one_process,
                                        two_heads)

torch.set_num_threads(1)

LARGE = "4.weight"      # 400 x 400 float32: 640 KB, reduced alone
# Adam divides by the root of the squared gradients: some of LARGE's are
# about 1e-10, and their rounding moves the weights by up to 5e-5 even in the
# first step, which reduces every gradient alone.
ADAM_ATOL = 2e-4


def make_model():
    """Seven small parameters and one large one."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 400), torch.nn.Tanh(),
                               torch.nn.Linear(400, 400), torch.nn.Tanh(),
                               torch.nn.Linear(400, 3))


def small_parameters(model):
    return [(name, p) for name, p in model.named_parameters() if name != LARGE]


def storage(tensor):
    return tensor.untyped_storage().data_ptr()


def train(make_optimizer, **options):
    """Train this model against one process on the whole batch (see
    test_torch_optimizer.check_against_one_process)."""
    return check_against_one_process(make_optimizer, model_factory=make_model, **options)


def step_beside_one_process(model, optimizer, reference, reference_optimizer, step):
    """One step of `reference` on the step's whole batch and one of `model`
    on this rank's rows of it; then the two must hold the same parameters."""
    r, n = hvd.rank(), hvd.size()
    x, y = batch(step, n * ROWS)
    reference_optimizer.zero_grad()
    F.mse_loss(reference(x), y).backward()
    reference_optimizer.step()
    optimizer.zero_grad()
    F.mse_loss(model(x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS]).backward()
    optimizer.step()
    assert_close(model, reference)


def assert_in_one_bucket(model):
    """Every small p.grad is a view of one flat tensor holding them all; the
    large one has its own memory."""
    grads = dict(model.named_parameters())
    storages = {storage(p.grad) for _, p in small_parameters(model)}
    assert len(storages) == 1, "small gradients are not in one bucket"
    flat = small_parameters(model)[0][1].grad.untyped_storage()
    assert flat.nbytes() == sum(p.numel() * 4 for _, p in small_parameters(model))
    assert storage(grads[LARGE].grad) not in storages


@mpi_test(np=(2, 3))
def test_training_with_buckets_matches_one_process():
    for overlap in (True, False):
        for set_to_none in (True, False):
            train(sgd, set_to_none=set_to_none, overlap=overlap)
            train(adam, atol=ADAM_ATOL, set_to_none=set_to_none, overlap=overlap)


@mpi_test(np=(2, 3))
def test_small_gradients_share_one_bucket_and_are_never_copied_when_kept():
    seen = {}

    def check(step, model, reference):
        if step == 0:
            return                      # the first step runs without buckets
        assert_in_one_bucket(model)
        where = {name: (p.grad, storage(p.grad), p.grad.data_ptr())
                 for name, p in model.named_parameters()}
        if seen:        # zero_grad(set_to_none=False) and backward wrote in place
            for name, (grad, flat, ptr) in where.items():
                assert grad is seen[name][0], name
                assert (flat, ptr) == seen[name][1:], name
        seen.update(where)

    train(sgd, steps=5, set_to_none=False, after_step=check)
    assert len(seen) == 8


@mpi_test(np=(2, 3))
def test_set_to_none_leaves_no_gradient_and_step_gives_the_average_in_the_bucket():
    r, n = hvd.rank(), hvd.size()
    copy = make_model()
    for overlap in (True, False):
        model = make_model()
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), overlap=overlap,
            named_parameters=model.named_parameters())
        for step in range(3):
            optimizer.zero_grad()
            assert all(p.grad is None for p in model.parameters())
            x, y = batch(10 * step + r, ROWS)
            copy.zero_grad()
            F.mse_loss(copy(x), y).backward()
            everyone = hvd.allgather_object([p.grad for p in copy.parameters()])
            F.mse_loss(model(x), y).backward()
            if step:    # each gradient went into its view as soon as it arrived
                assert_in_one_bucket(model)
            optimizer.step()
            for (name, p), parts in zip(model.named_parameters(), zip(*everyone)):
                torch.testing.assert_close(p.grad, sum(parts) / n, rtol=1e-5,
                                           atol=1e-7, msg=name)
            if step:
                assert_in_one_bucket(model)


@mpi_test(np=(2, 3))
def test_a_gradient_the_user_replaced_is_still_averaged():
    r, n = hvd.rank(), hvd.size()
    x, y = batch(r, ROWS)
    # What this rank sends, from a model without the optimizer (lr=0 keeps the
    # two equal): with overlap, reading p.grad after backward could already
    # show the average that the engine wrote in place.
    reference = make_model()
    F.mse_loss(reference(x), y).backward()
    for overlap in (True, False):
        model = make_model()
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), overlap=overlap,
            named_parameters=model.named_parameters())
        first, last = model[0].weight, model[6].bias
        for step in range(4):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
            # Before backward: autograd accumulates into the user's tensor.
            first.grad = torch.full_like(first, 10.0 * (r + 1))
            F.mse_loss(model(x), y).backward()
            local = reference[0].weight.grad + 10.0 * (r + 1)
            sent = reference[6].bias.grad
            # After backward: before step() sends it, the user's tensor counts;
            # once sent (overlap), the average of what was sent replaces it.
            last.grad = torch.full_like(last, float(r + 1))
            optimizer.step()
            everyone = hvd.allgather_object((local, sent))
            torch.testing.assert_close(first.grad, sum(e[0] for e in everyone) / n,
                                       rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                last.grad, sum(e[1] for e in everyone) / n if overlap
                else torch.full_like(last, (n + 1) / 2), rtol=1e-5, atol=1e-6)
            if step:
                assert_in_one_bucket(model)


@mpi_test(np=(2, 3))
def test_two_backward_passes_per_step_accumulate_in_the_bucket():
    for set_to_none in (True, False):
        for overlap in (True, False):
            model, _ = train(sgd, passes=2, set_to_none=set_to_none, overlap=overlap)
            assert_in_one_bucket(model)


@mpi_test(np=(2, 3))
def test_compressed_buckets_stay_close():
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        model, _ = train(sgd, steps=3, atol=2e-2, compression=compression)
        assert_in_one_bucket(model)
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@mpi_test(np=(2, 3))
def test_sum_predivide_and_groups_with_buckets():
    n = hvd.size()
    train(sgd, gradient_predivide_factor=float(n))
    # The sum of n averages, at 1/n of the learning rate, steps like the average.
    train(lambda params: torch.optim.SGD(params, lr=0.1 / n), op=hvd.Sum,
          make_reference=lambda params: torch.optim.SGD(params, lr=0.1))
    model = make_model()
    first = list(model[0].parameters())
    train(adam, atol=ADAM_ATOL, groups=[first])      # new model: these are foreign
    model, _ = train(adam, atol=ADAM_ATOL, groups=2)
    grads = [p.grad for p in model.parameters()]
    assert len({storage(g) for g in grads}) == len(grads), \
        "grouped parameters went into a bucket"


@mpi_test(np=(2, 3))
def test_ranks_listing_parameters_in_other_orders_form_rank_0s_buckets():
    reference, model = make_model(), make_model()
    named = list(model.named_parameters())
    if hvd.rank() > 0:
        named.reverse()
    reference_optimizer = sgd(reference.parameters())
    optimizer = hvd.DistributedOptimizer(sgd([p for _, p in named]),
                                         named_parameters=named)
    for step in range(4):
        step_beside_one_process(model, optimizer, reference, reference_optimizer, step)
    assert_identical_across_ranks(model)


@mpi_test(np=(2, 3))
def test_a_parameter_without_gradient_on_some_ranks_contributes_zeros_from_its_bucket():
    r, n = hvd.rank(), hvd.size()
    for set_to_none in (True, False):
        model, copy = two_heads(), two_heads()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters())
        for step in range(3):
            x = batch(10 * step + r, ROWS)[0][:, :4]
            copy.load_state_dict(model.state_dict())
            copy.zero_grad()
            loss_of(copy, x).backward()
            grads = [torch.zeros_like(p) if p.grad is None else p.grad
                     for p in copy.parameters()]
            everyone = hvd.allgather_object(grads)
            optimizer.zero_grad(set_to_none=set_to_none)
            loss_of(model, x).backward()
            optimizer.step()
            for (name, p), parts in zip(model.named_parameters(), zip(*everyone)):
                torch.testing.assert_close(p.grad, sum(parts) / n, rtol=1e-5, atol=1e-7,
                                           msg=name)
            assert_identical_across_ranks(model)
        assert len({storage(p.grad) for p in model.parameters()}) == 1


@mpi_test(np=(2, 3))
def test_a_process_set_forms_buckets_among_its_members_only():
    """Ranks 1.. average in a set (rank 1 alone in it with 2 ranks); rank 0
    steps on its own."""
    r, n = hvd.rank(), hvd.size()
    members = list(range(1, n))
    subset = hvd.add_process_set(members)
    try:
        reference, model = make_model(), make_model()
        reference_optimizer = sgd(reference.parameters())
        optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                             named_parameters=model.named_parameters(),
                                             process_set=subset)
        for step in range(4):
            x, y = batch(step, n * ROWS)
            mine = slice(r * ROWS, (r + 1) * ROWS)
            shard = slice(ROWS, n * ROWS) if r in members else mine
            reference_optimizer.zero_grad()
            F.mse_loss(reference(x[shard]), y[shard]).backward()
            reference_optimizer.step()
            optimizer.zero_grad()
            F.mse_loss(model(x[mine]), y[mine]).backward()
            optimizer.step()
            assert_close(model, reference)
        grads = {storage(p.grad) for _, p in small_parameters(model)}
        assert len(grads) == (1 if len(members) > 1 and r in members else 7)
    finally:
        hvd.remove_process_set(subset)


@mpi_test(np=(2, 3))
def test_a_sparse_embedding_gradient_stays_out_of_the_buckets_and_is_gathered_sparse():
    n = hvd.size()
    ids = torch.arange(n * 3).remainder(7).view(n, 3)

    def make():
        torch.manual_seed(2)
        return torch.nn.ModuleDict({"embedding": torch.nn.Embedding(7, 2, sparse=True),
                                    "head": torch.nn.Linear(2, 1)})

    def head_and_embedding_loss(net, rows):
        return embedding_loss(net["embedding"], rows) + net["head"](
            net["embedding"](rows)).pow(2).mean()

    for sparse_as_dense in (False, True):
        reference, model = make(), make()
        for _ in sparse_steps_beside_one_process(
                model, reference, head_and_embedding_loss, ids, 3,
                model["embedding"].weight, named_parameters=model.named_parameters(),
                sparse_as_dense=sparse_as_dense):
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p, q)
        head = model["head"]
        assert storage(head.weight.grad) == storage(head.bias.grad)


@mpi_test(np=(2, 3))
def test_zero_grad_refuses_while_a_bucket_travels_and_drop_step_starts_clean():
    r, n = hvd.rank(), hvd.size()
    reference, model = make_model(), make_model()
    reference_optimizer = sgd(reference.parameters())
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()), overlap=True,
                                         named_parameters=model.named_parameters())
    mine = slice(r * ROWS, (r + 1) * ROWS)
    for step in range(4):
        x, y = batch(step, n * ROWS)
        optimizer.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        with pytest.raises(AssertionError, match="zero_grad"):
            optimizer.zero_grad()
        if step == 2:
            optimizer.drop_step()
            assert all(p.grad is None for p in model.parameters())
            continue
        optimizer.step()
        reference_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        assert_close(model, reference)
    assert_in_one_bucket(model)


def allreduces_of_one_step(model, optimizer, r, set_to_none=True):
    """The names of the allreduces rank 0 submitted in one step, from the timeline."""
    directory = hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else None)
    path = os.path.join(directory, "timeline.json")
    hvd.start_timeline(path)
    optimizer.zero_grad(set_to_none=set_to_none)
    x, y = batch(r, ROWS)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    hvd.stop_timeline()
    if r != 0:
        return None
    with open(path) as file:
        events = json.load(file)
    shutil.rmtree(directory)
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("name") == "process_name"}
    return sorted(rows[e["pid"]] for e in events
                  if e.get("name") == "NEGOTIATE_ALLREDUCE" and e["ph"] == "B")


@mpi_test(np=(2, 3))
def test_a_step_submits_one_allreduce_per_bucket_and_per_large_gradient():
    r = hvd.rank()
    for overlap in (True, False):
        model = make_model()
        optimizer = hvd.DistributedOptimizer(sgd(model.parameters()), overlap=overlap,
                                             named_parameters=model.named_parameters())
        first = allreduces_of_one_step(model, optimizer, r)
        later = [allreduces_of_one_step(model, optimizer, r, set_to_none)
                 for set_to_none in (True, False)]
        if r == 0:
            assert len(first) == 8                  # the first step: one per parameter
            bucket = "DistributedOptimizer.bucket.0 (6.bias .. 0.weight, 7 parameters)"
            assert later == [[LARGE, bucket]] * 2


@mpi_test(np=(2, 3), env={"MPITRAIN_FUSION_THRESHOLD": "8000"})
def test_buckets_hold_at_most_the_fusion_threshold():
    r = hvd.rank()
    model, optimizer = train(sgd, steps=3)
    names = allreduces_of_one_step(model, optimizer, r)
    # In backward's order: 6.bias, 6.weight, 4.bias (6412 bytes); 2.bias (1600)
    # would pass 8000, 2.weight (25600) is over on its own, 0.bias and 0.weight.
    if r == 0:
        assert names == [LARGE,
                         "DistributedOptimizer.bucket.0 (6.bias .. 4.bias, 3 parameters)",
                         "DistributedOptimizer.bucket.1 (2.bias, 1 parameter)",
                         "DistributedOptimizer.bucket.2 (2.weight, 1 parameter)",
                         "DistributedOptimizer.bucket.3 (0.bias .. 0.weight, 2 parameters)"]
    grads = {storage(p.grad) for _, p in small_parameters(model)}
    assert len(grads) == 4


def test_plan_in_backward_order_by_dtype_within_the_cap():
    params = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(10),
              torch.zeros(20), torch.zeros(5, dtype=torch.float64)]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    assert buckets.plan(params, names, cap=120) == [["p4", "p1"], ["p3", "p2"], ["p0"]]
    assert buckets.plan(params, names, cap=10) == [["p4"], ["p3"], ["p2"], ["p1"], ["p0"]]
    assert buckets.small(torch.zeros(fusion.ALONE_BYTES // 4 - 1))
    assert not buckets.small(torch.zeros(fusion.ALONE_BYTES // 4))
