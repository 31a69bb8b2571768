"""Gradient compressors with their own communication, and error feedback, on 2 and 3 ranks."""

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from mpitrain.errors import CollectiveValueError
from mpitrain.torch.compression.powersgd import orthonormal
from tests.mpi_harness import mpi_test
from tests.test_torch_optimizer import (ROWS, assert_identical_across_ranks, batch,
                                        check_against_one_process, make_model, sgd)

torch.set_num_threads(1)


def compressors(error_feedback):
    """One of each, compressing any parameter (the test model's are small)."""
    return [hvd.Compression.topk(0.1, error_feedback, min_elements=0),
            hvd.Compression.onebit(8, error_feedback, min_elements=0),
            hvd.Compression.int8(16, error_feedback, min_elements=0),
            hvd.Compression.int4(16, error_feedback, min_elements=0),
            hvd.Compression.powersgd(2, error_feedback, min_elements=0)]


def gradient_of(rank, step=0, shape=(12, 10)):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=generator)


def expected_sum(compressor, step_gradients):
    """What an exchange of these gradients (one per rank) must sum to."""
    if isinstance(compressor, hvd.Compression.error_feedback):
        compressor = compressor.compressor
    if isinstance(compressor, hvd.compression.PowerSGD):
        matrices = [g.reshape(g.shape[0], -1) for g in step_gradients]
        q = torch.randn(matrices[0].shape[1], compressor.rank,
                        generator=torch.Generator().manual_seed(compressor.seed))
        p = orthonormal(sum(m @ q for m in matrices))
        return sum(p @ (m.t() @ p).t() for m in matrices).view(step_gradients[0].shape)
    return sum(compressor.decompress(*compressor.compress(g)) for g in step_gradients)


def test_round_trips_keep_what_each_compressor_promises():
    x = gradient_of(0, shape=(37, 29))
    topk, onebit, int8, int4, powersgd = compressors(error_feedback=False)
    kept = topk.decompress(*topk.compress(x))
    assert (kept != 0).sum() == round(0.1 * x.numel())
    assert kept.abs().min() == 0 and kept[kept != 0].abs().min() >= x.abs().flatten() \
        .kthvalue(x.numel() - round(0.1 * x.numel())).values
    torch.testing.assert_close(kept[kept != 0], x[kept != 0], rtol=0, atol=0)
    signs = onebit.decompress(*onebit.compress(x))
    assert torch.equal(signs.sign(), x.sign())
    torch.testing.assert_close(signs.abs().flatten()[:8].mean(), x.abs().flatten()[:8].mean())
    for quantize in (int8, int4):
        payload, context = quantize.compress(x)
        step = x.abs().flatten()[:16].max() / quantize.levels
        error = (quantize.decompress(payload, context) - x).abs().flatten()[:16]
        assert error.max() <= step / 2 + 1e-6
    assert int4.compress(x)[0][0].numel() == (x.numel() + 1) // 2      # two to a byte
    low_rank = gradient_of(1, shape=(20, 2)) @ gradient_of(2, shape=(2, 15))
    torch.testing.assert_close(powersgd.decompress(*powersgd.compress(low_rank, "m")),
                               low_rank, rtol=1e-4, atol=1e-4)


def test_collectives_refuse_compressors_that_send_their_own_payload():
    tensor = torch.ones(4, 4)
    calls = {"allreduce": lambda c: hvd.allreduce(tensor, compression=c),
             "grouped_allreduce": lambda c: hvd.grouped_allreduce([tensor], compression=c),
             "reducescatter": lambda c: hvd.reducescatter(tensor, compression=c),
             "grouped_reducescatter":
                 lambda c: hvd.grouped_reducescatter([tensor], compression=c)}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"^{name}\(compression=ErrorFeedback.*"
                                             r"only as DistributedOptimizer"):
            call(hvd.Compression.topk(0.1))


@mpi_test()
def test_exchange_sums_every_ranks_approximation():
    n = hvd.size()
    everyone = [gradient_of(rank) for rank in range(n)]
    for compressor in compressors(error_feedback=False):
        exchange = compressor.start(everyone[hvd.rank()].clone(), "w", hvd.global_process_set)
        total = exchange.wait()
        torch.testing.assert_close(total, expected_sum(compressor, everyone),
                                   rtol=1e-5, atol=1e-5, msg=repr(compressor))
        assert hvd.allgather_object(total.numpy().tobytes()) == [total.numpy().tobytes()] * n
        assert 0 < compressor.bytes_sent < everyone[0].numel() * 4


@mpi_test()
def test_a_shape_that_differs_between_ranks_fails_on_every_rank():
    for compressor in compressors(error_feedback=False)[:4]:
        exchange = compressor.start(torch.ones(4, 3 + hvd.rank()), "w",
                                    hvd.global_process_set)
        with pytest.raises(ValueError, match=r"'w' differs in shape between ranks: "
                                             r"rank 0: \[4, 3\], rank 1: \[4, 4\]"):
            exchange.wait()


@mpi_test()
def test_error_feedback_carries_every_residual_into_the_next_step():
    r = hvd.rank()
    for compressor in compressors(error_feedback=True):
        sent = torch.zeros(12, 10)
        for step in range(3):
            before = compressor.residuals.get("w", torch.zeros(12, 10))
            gradient = gradient_of(r, step)
            exchange = compressor.start(gradient, "w", hvd.global_process_set)
            exchange.wait()
            assert torch.equal(compressor.residuals["w"], gradient + before - exchange.mine)
            sent += exchange.mine
        everything = sum(gradient_of(r, step) for step in range(3))
        torch.testing.assert_close(sent + compressor.residuals["w"], everything,
                                   rtol=1e-5, atol=1e-5, msg=repr(compressor))


def train(optimizer, model, steps=4, first_step=0):
    r, n = hvd.rank(), hvd.size()
    for step in range(first_step, first_step + steps):
        x, y = batch(step, n * ROWS)
        optimizer.zero_grad()
        F.mse_loss(model(x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS]).backward()
        optimizer.step()


@mpi_test()
def test_ranks_end_with_identical_parameters():
    for feedback in (True, False):
        for compressor in compressors(feedback):
            model = make_model()
            start = [p.detach().clone() for p in model.parameters()]
            optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                                 named_parameters=model.named_parameters(),
                                                 compression=compressor)
            train(optimizer, model)
            assert_identical_across_ranks(model)
            assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), start))


@mpi_test()
def test_submitting_during_backward_or_in_step_gives_the_same_parameters():
    for make in (0, 1, 4):          # topk, onebit, powersgd, with error feedback
        trained = []
        for overlap in (True, False):
            model = make_model()
            optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                                 named_parameters=model.named_parameters(),
                                                 compression=compressors(True)[make],
                                                 overlap=overlap)
            train(optimizer, model)
            trained.append([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(p, q) for p, q in zip(*trained)), make


@mpi_test()
def test_topk_of_every_entry_trains_like_one_process():
    check_against_one_process(sgd, compression=hvd.Compression.topk(1.0, min_elements=0))


@mpi_test()
def test_a_user_written_horovod_compressor_still_goes_through_the_allreduce():
    class Doubling(hvd.Compression.none):
        @staticmethod
        def compress(tensor):
            return tensor * 2, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor / 2

    check_against_one_process(sgd, compression=Doubling)


def averaged_gradients(compression):
    """p.grad after one synchronize, and the exact average of the ranks' gradients."""
    model, copy = make_model(), make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         compression=compression)
    x, y = batch(hvd.rank(), ROWS)
    F.mse_loss(copy(x), y).backward()
    exact = {name: sum(parts) / hvd.size() for name, parts in zip(
        dict(copy.named_parameters()),
        zip(*hvd.allgather_object([p.grad for p in copy.parameters()])))}
    F.mse_loss(model(x), y).backward()
    optimizer.synchronize()
    return {name: p.grad for name, p in model.named_parameters()}, exact


@mpi_test()
def test_small_and_one_dimensional_parameters_go_uncompressed_by_default():
    grads, exact = averaged_gradients(hvd.Compression.topk(1, min_elements=1))
    for name in ("0.bias", "2.bias"):
        torch.testing.assert_close(grads[name], exact[name], msg=name)
    for name in ("0.weight", "2.weight"):
        assert (grads[name] != 0).sum() <= hvd.size(), name     # one entry per rank
    grads, exact = averaged_gradients(hvd.Compression.topk(1, min_elements=25))
    torch.testing.assert_close(grads["2.weight"], exact["2.weight"])    # 24 elements
    assert (grads["0.weight"] != 0).sum() <= hvd.size()                 # 48


@mpi_test()
def test_a_choice_per_parameter_by_name_or_function():
    int4 = hvd.Compression.int4(4, min_elements=10 ** 6)   # chosen, so the size is no matter
    grads, exact = averaged_gradients({"2.weight": int4})
    for name in ("0.weight", "0.bias", "2.bias"):
        torch.testing.assert_close(grads[name], exact[name], msg=name)
    assert not torch.equal(grads["2.weight"], exact["2.weight"])
    torch.testing.assert_close(grads["2.weight"], exact["2.weight"], rtol=0, atol=0.1)
    grads, exact = averaged_gradients(lambda name, p: int4 if name == "0.bias" else None)
    assert not torch.equal(grads["0.bias"], exact["0.bias"])
    torch.testing.assert_close(grads["0.weight"], exact["0.weight"])
    with pytest.raises(ValueError, match="'0.weight'"):
        averaged_gradients({"0.weight": hvd.Compression.fp16})
    with pytest.raises(ValueError, match="nonexistent"):
        averaged_gradients({"nonexistent": int4})


def compressed_training():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(),
        compression={"0.weight": hvd.Compression.onebit(8, min_elements=0),
                     "2.weight": hvd.Compression.powersgd(2, min_elements=0)})
    return model, optimizer


def compression_state(optimizer):
    return optimizer.state_dict().get("compression", {"parameters": {}})["parameters"]


@mpi_test()
def test_residuals_and_powersgd_state_travel_with_the_optimizer_state():
    r = hvd.rank()
    model, optimizer = compressed_training()
    train(optimizer, model, steps=2)
    saved = compression_state(optimizer)
    assert set(saved) == {"0.weight", "2.weight"}
    assert set(saved["2.weight"]) == {"residual", "powersgd_q"}
    directory = hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else None)
    path = os.path.join(directory, "checkpoint.pt")
    hvd.save_checkpoint(path, model, optimizer)

    resumed_model, resumed = compressed_training()
    hvd.load_checkpoint(path, resumed_model, resumed)
    loaded = compression_state(resumed)
    roots_q = hvd.broadcast_object(saved["2.weight"]["powersgd_q"], root_rank=0)
    assert torch.equal(loaded["2.weight"]["powersgd_q"], roots_q)
    # Residuals are each rank's own error: rank 0's come back on rank 0 only.
    assert ("residual" in loaded.get("0.weight", {})) == (r == 0)
    if r == 0:
        assert torch.equal(loaded["0.weight"]["residual"], saved["0.weight"]["residual"])
    train(resumed, resumed_model, steps=2, first_step=2)
    assert_identical_across_ranks(resumed_model)

    # broadcast_optimizer_state: Q is the root's everywhere, residuals stay each rank's.
    mine = compression_state(optimizer)["0.weight"]["residual"].clone()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert torch.equal(compression_state(optimizer)["0.weight"]["residual"], mine)
    q = compression_state(optimizer)["2.weight"]["powersgd_q"]
    assert all(torch.equal(q, other) for other in hvd.allgather_object(q))


def test_a_choice_per_parameter_that_is_no_compressor_is_refused_by_name():
    from mpitrain.torch.compression import choice
    weight, bias = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(1))
    names = {weight: "fc.weight", bias: "fc.bias"}
    _, chosen = choice.split({"fc.weight": hvd.Compression.topk(0.5),
                              "fc.bias": hvd.Compression.none}, [weight, bias], names)
    assert list(chosen) == [weight]
    with pytest.raises(ValueError, match="compression chose 'fp16' for 'fc.bias': a "
                                         "choice per parameter is Compression.topk"):
        choice.split(lambda name, p: "fp16" if name == "fc.bias" else None,
                     [weight, bias], names)


def compressors_differing_on_rank_1():
    """(what ranks 0 and 2 choose, what rank 1 chooses): issue 28's pairs."""
    c = hvd.Compression
    return [(c.int8(256, min_elements=0), c.int8(512, min_elements=0)),
            (c.onebit(128, min_elements=0), c.onebit(512, min_elements=0)),
            (c.topk(0.1, min_elements=0), c.topk(0.2, min_elements=0)),
            (c.int8(min_elements=0), c.onebit(min_elements=0)),
            (c.topk(0.1, error_feedback=False, min_elements=0), c.none)]


@mpi_test()
def test_compressors_that_differ_between_ranks_fail_every_rank_naming_each():
    """Other settings garbled the decompression (torch's size error); another
    kind, or none, left the ranks waiting for each other until the stall."""
    r = hvd.rank()
    for usual, other in compressors_differing_on_rank_1():
        model = make_model()
        with pytest.raises(hvd.MismatchError) as caught:
            hvd.DistributedOptimizer(sgd(model.parameters()),
                                     named_parameters=model.named_parameters(),
                                     compression=other if r == 1 else usual)
        others = "ranks 0, 2" if hvd.size() == 3 else "rank 0"
        rank_1 = "uncompressed" if other is hvd.Compression.none else repr(other)
        assert str(caught.value) == (
            "DistributedOptimizer(compression=...): the compressor of '0.weight' differs "
            f"between ranks ({others}: {usual!r}; rank 1: {rank_1}): every rank must "
            "use the same"), str(caught.value)
    model = make_model()                            # the same everywhere: trains
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.int8(min_elements=0))
    train(optimizer, model, steps=2)
    assert_identical_across_ranks(model)


@mpi_test()
def test_a_choice_that_fails_on_one_rank_fails_every_rank():
    model = make_model()
    choice = {"nothing.such": hvd.Compression.topk(0.1)} if hvd.rank() == 1 else {}
    error = ValueError if hvd.rank() == 1 else CollectiveValueError
    with pytest.raises(error, match="compression names nothing.such, which the "
                                    "optimizer does not train") as caught:
        hvd.DistributedOptimizer(sgd(model.parameters()),
                                 named_parameters=model.named_parameters(),
                                 compression=choice)
    if hvd.rank() != 1:
        assert str(caught.value).startswith("DistributedOptimizer(compression=...) "
                                            "failed on rank 1: ValueError: ")
