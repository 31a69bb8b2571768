"""LocalSGDOptimizer: local steps, then the ranks' parameters averaged every K steps."""

import json
import os
import re
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from mpitrain.torch.optimizers.local_sgd import AVERAGE_NAME
from tests.mpi_harness import mpi_test
from tests.test_mixed_precision import TF_ENV, keras_modules
from tests.test_torch_buckets import step_beside_one_process
from tests.test_torch_optimizer import (ROWS, assert_close, assert_identical_across_ranks,
                                        batch, make_model)

torch.set_num_threads(1)


def local_step(model, optimizer, step):
    """One step on this rank's own rows (they differ between ranks)."""
    x, y = batch(100 * hvd.rank() + step, ROWS)
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def mean_across_ranks(tensors):
    everyone = hvd.allgather_object([t.detach().clone() for t in tensors])
    return [sum(parts) / hvd.size() for parts in zip(*everyone)]


def identical_across_ranks(model):
    mine = [p.detach().numpy().tobytes() for p in model.parameters()]
    return all(other == mine for other in hvd.allgather_object(mine))


def allreduce_rows(path):
    """{row name: ALLREDUCE spans} of rank 0's timeline."""
    events = json.load(open(path))
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"
            and e["name"] == "process_name"}
    counts = {}
    for e in events:
        if e.get("ph") == "B" and e.get("name") == "ALLREDUCE":
            counts[rows[e["pid"]]] = counts.get(rows[e["pid"]], 0) + 1
    return counts


@mpi_test()
def test_k_local_steps_then_the_average_of_independent_trainings():
    """Without overlap, K local steps of SGD with momentum, then every rank
    holds the mean of K steps trained alone; parameters and momentum both."""
    period = 3
    model, alone = make_model(), make_model()
    optimizer = hvd.LocalSGDOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), period=period,
        average_optimizer_state=True, overlap_averaging=False)
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=0.1, momentum=0.9)
    path = os.path.join(tempfile.gettempdir(), f"mpitrain-local-sgd-{hvd.size()}.json")
    hvd.start_timeline(path)
    for step in range(2 * period):
        local_step(model, optimizer, step)
        local_step(alone, alone_optimizer, step)
        if step % period < period - 1:
            assert not identical_across_ranks(model), f"step {step} was not local"
            assert_close(model, alone)
            continue
        assert_identical_across_ranks(model)
        averaged = list(alone.parameters()) + [
            alone_optimizer.state[p]["momentum_buffer"] for p in alone.parameters()]
        for tensor, mean in zip(averaged, mean_across_ranks(averaged)):
            tensor.data.copy_(mean)
        assert_close(model, alone)
        for p, q in zip(model.parameters(), alone.parameters()):
            torch.testing.assert_close(optimizer.state[p]["momentum_buffer"],
                                       alone_optimizer.state[q]["momentum_buffer"])
    hvd.stop_timeline()
    if hvd.rank() == 0:
        # Local steps send nothing: only the two averages of 4 parameters and
        # their 4 momentum buffers, one grouped call each.
        rows = allreduce_rows(path)
        os.remove(path)
        assert rows == {name: 2 for name in [f"{AVERAGE_NAME}_{i}of8" for i in range(8)]}


@mpi_test()
def test_warmup_steps_average_gradients_then_ranks_step_on_their_own():
    model, reference = make_model(), make_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      period=4, warmup_steps=2)
    for step in range(2):
        assert not optimizer.local_phase
        step_beside_one_process(model, optimizer, reference, reference_optimizer, step)
        assert_identical_across_ranks(model)
    assert optimizer.local_phase
    local_step(model, optimizer, 2)
    assert not identical_across_ranks(model)
    assert all(p.grad is not None for p in model.parameters())


@mpi_test()
def test_overlapped_average_keeps_the_next_local_step_on_top_of_it():
    period, lr = 2, 0.1
    model = make_model()
    optimizer = hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                      named_parameters=model.named_parameters(),
                                      period=period)
    for step in range(period):
        local_step(model, optimizer, step)
    # The average of these travels during the next step, which starts from them.
    snapshot = [p.detach().clone() for p in model.parameters()]
    assert not identical_across_ranks(model)
    local_step(model, optimizer, period)
    alone = make_model()
    for p, q in zip(alone.parameters(), snapshot):
        p.data.copy_(q)
    local_step(alone, torch.optim.SGD(alone.parameters(), lr=lr), period)
    for p, q, s, mean in zip(model.parameters(), alone.parameters(), snapshot,
                             mean_across_ranks(snapshot)):
        torch.testing.assert_close(p, mean + (q - s), rtol=1e-5, atol=1e-6)
    optimizer.average_parameters()
    assert_identical_across_ranks(model)


@mpi_test()
def test_the_grad_scaler_recipe_runs_unchanged_in_the_local_phase():
    model = make_model()
    optimizer = hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      period=2, warmup_steps=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(3):
        x, y = batch(100 * hvd.rank() + step, ROWS)
        optimizer.zero_grad()
        with optimizer.no_sync():
            scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        # Synchronous step 0, local step 1, local step 2 with the average of
        # step 1 applied first: the ranks agree only after the warm-up step.
        assert identical_across_ranks(model) == (step == 0)
    optimizer.average_parameters()
    assert_identical_across_ranks(model)


@mpi_test()
def test_bad_period_and_warmup_are_refused():
    model = make_model()
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="period must be"):
            hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), period=bad)
    with pytest.raises(ValueError, match="warmup_steps must be"):
        hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), warmup_steps=-1)
    with pytest.raises(ValueError, match="op=Adasum"):
        hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)


@mpi_test()
def test_settings_that_differ_between_ranks_fail_every_rank_at_construction():
    """A period or warm-up of its own on rank 1 paired averages of different
    steps, and the last average waited for the stall shutdown."""
    r = hvd.rank()
    others = "ranks 0, 2" if hvd.size() == 3 else "rank 0"
    for setting, usual, other in (("period", 4, 2), ("warmup_steps", 0, 1),
                                  ("average_optimizer_state", False, True)):
        model = make_model()
        with pytest.raises(hvd.MismatchError) as caught:
            hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  **{setting: other if r == 1 else usual})
        assert str(caught.value) == (
            f"LocalSGDOptimizer: {setting} differs between ranks ({others}: {usual}; "
            f"rank 1: {other}): every rank must use the same")
    model = make_model()
    with pytest.raises(ValueError) as caught:           # a bad period on rank 1 alone
        hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              period=0 if r == 1 else 4)
    assert str(caught.value).startswith(
        "period must be" if r == 1 else
        "LocalSGDOptimizer failed on rank 1: ValueError: period must be")
    optimizer = hvd.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), period=1,
                                      overlap_averaging=False)
    local_step(model, optimizer, 0)                     # the same everywhere: works
    assert identical_across_ranks(model)


@mpi_test(env=TF_ENV, timeout=180)
def test_keras_callback_averages_independent_trainings_every_period_after_warmup():
    tf, keras, hvd_keras = keras_modules()

    class SameOnEveryRank(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen, self.weights = [], []

        def on_train_batch_end(self, batch, logs=None):
            mine = [w.tolist() for w in self.model.get_weights()]
            self.seen.append(all(other == mine for other in hvd.allgather_object(mine)))
            self.weights.append(self.model.get_weights())

    def fit(batches, *callbacks, optimizer=None):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1, momentum=0.9),
                      loss="mse", jit_compile=False)
        model.fit(x[:batches * ROWS], y[:batches * ROWS], batch_size=ROWS, epochs=1,
                  shuffle=False, verbose=0, callbacks=list(callbacks))
        return model

    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(4 * ROWS, 6)).astype(np.float32)
    y = rng.normal(size=(4 * ROWS, 3)).astype(np.float32)

    alone = mean_across_ranks([torch.from_numpy(w) for w in fit(2).get_weights()])
    def momentum_same_on_every_rank(model):
        mine = [v.numpy().tolist() for v in model.optimizer.variables if len(v.shape)]
        return all(other == mine for other in hvd.allgather_object(mine))

    recorder = SameOnEveryRank()
    model = fit(4, hvd_keras.callbacks.LocalSGDCallback(2, average_optimizer_state=True),
                recorder)
    assert recorder.seen == [False, True, False, True]
    for got, want in zip(recorder.weights[1], alone):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    assert momentum_same_on_every_rank(model)
    recorder = SameOnEveryRank()
    model = fit(4, hvd_keras.callbacks.LocalSGDCallback(2, warmup_batches=1), recorder)
    assert recorder.seen == [True, False, True, False]
    assert not momentum_same_on_every_rank(model)
    with pytest.raises(ValueError, match="compile with the plain optimizer"):
        fit(1, hvd_keras.callbacks.LocalSGDCallback(2),
            optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    others = "ranks 0, 2" if hvd.size() == 3 else "rank 0"
    with pytest.raises(hvd.MismatchError, match=re.escape(
            f"LocalSGDCallback: period differs between ranks ({others}: 3; rank 1: 2)")):
        fit(1, hvd_keras.callbacks.LocalSGDCallback(2 if hvd.rank() == 1 else 3))
