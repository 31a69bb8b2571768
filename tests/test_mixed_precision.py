"""Mixed-precision recipes (docs/mixed-precision.md): ranks end identical, and an
overflow on one rank skips the step on every rank."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpitrain.torch as hvd
from tests.mpi_harness import mpi_test
from tests.test_torch_optimizer import (ROWS, assert_identical_across_ranks, batch,
                                        local_gradients, make_model)

torch.set_num_threads(1)
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
OVERFLOW_STEP = 2


def own_batch(step):
    return batch(100 * hvd.rank() + step, ROWS)


def same_on_every_rank(value):
    return all(other == value for other in hvd.allgather_object(value))


@mpi_test()
def test_float16_autocast_and_grad_scaler_skip_an_overflow_of_rank_1_everywhere():
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(4):
        x, y = own_batch(step)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        if step == OVERFLOW_STEP and hvd.rank() == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        optimizer.synchronize()
        # The scaler's check sees the averaged gradients: rank 1's inf is everywhere.
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert finite == (step != OVERFLOW_STEP)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
        assert_identical_across_ranks(model)
        skipped = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        assert skipped == (step == OVERFLOW_STEP)
        assert same_on_every_rank(scaler.get_scale())
    assert scaler.get_scale() == 2.0 ** 9


@mpi_test()
def test_bfloat16_autocast_steps_with_the_average_of_every_ranks_gradients():
    model, copy = make_model(), make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    for step in range(3):
        x, y = own_batch(step)
        for p, q in zip(copy.parameters(), model.parameters()):
            p.data.copy_(q)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            copy_loss = F.mse_loss(copy(x), y)
        mine = local_gradients(copy, copy_loss)
        expected = [sum(parts) / hvd.size() for parts in zip(*hvd.allgather_object(mine))]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        for (name, p), average in zip(model.named_parameters(), expected):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, average, rtol=1e-5, atol=1e-6, msg=name)
        assert_identical_across_ranks(model)


def keras_modules():
    tf = pytest.importorskip("tensorflow")
    import keras
    import mpitrain.tensorflow.keras as hvd_keras
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf, keras, hvd_keras


@mpi_test(env=TF_ENV, timeout=180)
def test_keras_mixed_float16_with_loss_scale_optimizer_skips_an_overflow_everywhere():
    tf, keras, hvd_keras = keras_modules()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(3),
                                  keras.layers.Activation("linear", dtype="float32")])
        optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=2.0 ** 10))
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        rng = np.random.default_rng(hvd_keras.rank())
        x = rng.normal(size=(3 * ROWS, 6)).astype(np.float32)
        y = rng.normal(size=(3 * ROWS, 3)).astype(np.float32)
        model.fit(x, y, batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
        weights = model.get_weights()
        assert same_on_every_rank([w.tolist() for w in weights])
        assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 10
        # Beyond float16's range on rank 1 only: its gradients are not finite.
        if hvd_keras.rank() == 1:
            x[0, 0] = 1e6
        model.fit(x[:ROWS], y[:ROWS], batch_size=ROWS, epochs=1, shuffle=False, verbose=0)
        for before, after in zip(weights, model.get_weights()):
            np.testing.assert_array_equal(before, after)
        assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 9
    finally:
        keras.mixed_precision.set_global_policy("float32")


@mpi_test(env=TF_ENV, timeout=180)
def test_keras_loss_scale_optimizer_around_distributed_optimizer_is_refused():
    tf, keras, hvd_keras = keras_modules()
    wrong = keras.optimizers.LossScaleOptimizer(
        hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    variable = keras.Variable(np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"Wrap the other way round: "
                       r"hvd.DistributedOptimizer\(keras.optimizers.LossScaleOptimizer"):
        wrong.apply([tf.ones(3)], [variable])
    assert variable.numpy().tolist() == [1.0, 1.0, 1.0]
