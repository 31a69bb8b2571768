"""optimizer.no_sync(): backward passes inside accumulate locally and send nothing."""

import os
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test
from tests.test_local_sgd import allreduce_rows
from tests.test_mixed_precision import TF_ENV, keras_modules
from tests.test_torch_optimizer import (ROWS, assert_identical_across_ranks, batch,
                                        local_gradients, make_model)

torch.set_num_threads(1)


def micro_batch(step, index):
    return batch(1000 * hvd.rank() + 10 * step + index, ROWS)


@mpi_test()
def test_no_sync_sends_nothing_and_the_next_backward_sends_the_sum():
    """Rank r runs r + 1 micro-batches inside no_sync(), then one outside:
    each gradient travels once, holding the sum of this rank's passes."""
    model, copy = make_model(), make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    path = os.path.join(tempfile.gettempdir(), f"mpitrain-no-sync-{hvd.size()}.json")
    for step in range(3):
        if step == 0:
            hvd.start_timeline(path)
        passes = hvd.rank() + 2
        for p, q in zip(copy.parameters(), model.parameters()):
            p.data.copy_(q)
        expected = [sum(parts) for parts in zip(*[
            local_gradients(copy, F.mse_loss(copy(x), y))
            for x, y in (micro_batch(step, i) for i in range(passes))])]
        expected = [sum(parts) / hvd.size() for parts in zip(*hvd.allgather_object(expected))]
        optimizer.zero_grad()
        with optimizer.no_sync():
            for i in range(passes - 1):
                x, y = micro_batch(step, i)
                F.mse_loss(model(x), y).backward()
        x, y = micro_batch(step, passes - 1)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if step == 0:
            hvd.stop_timeline()
        for (name, p), average in zip(model.named_parameters(), expected):
            torch.testing.assert_close(p.grad, average, rtol=1e-5, atol=1e-6, msg=name)
        assert_identical_across_ranks(model)
    if hvd.rank() == 0:
        rows = allreduce_rows(path)
        os.remove(path)
        assert rows == {name: 1 for name, _ in model.named_parameters()}


@mpi_test()
def test_step_inside_no_sync_and_nested_no_sync_are_refused():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = micro_batch(0, 0)
    with optimizer.no_sync():
        F.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with optimizer.no_sync():
                pass
        with pytest.raises(RuntimeError, match="one more backward pass after the block"):
            optimizer.step()
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    assert_identical_across_ranks(model)


@mpi_test()
def test_passes_inside_no_sync_do_not_count_towards_backward_passes_per_step():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         backward_passes_per_step=2)
    x, y = micro_batch(0, 0)
    with optimizer.no_sync():
        for _ in range(hvd.rank() + 1):
            F.mse_loss(model(x), y).backward()
    for _ in range(2):
        F.mse_loss(model(x), y).backward()
    optimizer.step()
    assert_identical_across_ranks(model)


@mpi_test(env=TF_ENV, timeout=180)
def test_keras_backward_passes_per_step_sends_only_on_the_last_micro_batch():
    tf, keras, hvd_keras = keras_modules()
    passes, steps = 3, 6
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(
        keras.optimizers.SGD(0.1), backward_passes_per_step=passes,
        average_aggregated_gradients=True), loss="mse", jit_compile=False)
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(steps * ROWS, 6)).astype(np.float32)
    y = rng.normal(size=(steps * ROWS, 3)).astype(np.float32)
    path = os.path.join(tempfile.gettempdir(), f"mpitrain-keras-passes-{hvd.size()}.json")
    hvd.start_timeline(path)
    model.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
    hvd.stop_timeline()
    assert all(other == [w.tolist() for w in model.get_weights()] for other in
               hvd.allgather_object([w.tolist() for w in model.get_weights()]))
    if hvd.rank() == 0:
        rows = allreduce_rows(path)
        os.remove(path)
        # The kernel and the bias, each reduced once per 3 steps.
        assert len(rows) == 2 and set(rows.values()) == {steps // passes}, rows
