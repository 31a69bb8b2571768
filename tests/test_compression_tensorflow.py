"""TensorFlow/Keras gradient compressors: the torch ones' math, and training on 2 and 3 ranks."""

import os
import re
import shutil
import tempfile

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import mpitrain.tensorflow as hvd_tf  # noqa: E402
import mpitrain.tensorflow.keras as hvd  # noqa: E402
from tests.keras_models import make_model  # noqa: E402
from tests.test_keras_training import (BATCH, TF_ENV, assert_close,  # noqa: E402
                                       assert_same_on_every_rank, dataset, one_thread,
                                       reference_weights, shard)


def test_the_numpy_compressors_round_trip_like_the_torch_ones():
    torch = pytest.importorskip("torch")
    import mpitrain.torch as hvd_torch
    x = np.random.default_rng(0).standard_normal((37, 29)).astype(np.float32)
    for make in ("topk", "onebit", "int8", "int4"):
        arguments = (0.1,) if make == "topk" else (16,)
        ours = getattr(hvd_tf.Compression, make)(*arguments, error_feedback=False)
        theirs = getattr(hvd_torch.Compression, make)(*arguments, error_feedback=False)
        got = ours.decompress(*ours.compress(x))
        want = theirs.decompress(*theirs.compress(torch.from_numpy(x))).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=make)
        assert sum(p.nbytes for p in ours.compress(x)[0]) == \
            sum(p.numel() * p.element_size() for p in theirs.compress(torch.from_numpy(x))[0])


def test_bad_arguments_are_refused_as_by_the_torch_factories():
    for make, arguments, message in (("topk", (0,), "topk takes a fraction"),
                                     ("onebit", (0,), "chunk_size must be"),
                                     ("int4", (2.5,), "chunk_size must be"),
                                     ("powersgd", (0,), "powersgd takes a rank")):
        with pytest.raises(ValueError, match=message):
            getattr(hvd_tf.Compression, make)(*arguments)
    with pytest.raises(ValueError, match="min_elements must be"):
        hvd_tf.Compression.int8(min_elements=-1)


def test_collectives_refuse_compressors_that_send_their_own_payload():
    tensor = np.ones((4, 4), np.float32)
    for name, call in (("allreduce", hvd_tf.allreduce),
                       ("reducescatter", hvd_tf.reducescatter)):
        with pytest.raises(ValueError, match=rf"^{name}\(compression=TopK.*"
                                             r"only as DistributedOptimizer"):
            call(tensor, compression=hvd_tf.Compression.topk(0.1, error_feedback=False))

@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_keras_fit_with_topk_of_every_entry_equals_one_process():
    one_thread()
    steps = 3
    x, y = dataset(steps)
    expected = reference_weights(x, y, 1, keras.optimizers.SGD(0.1), steps)
    model = make_model(0)
    topk = hvd.Compression.topk(1.0, min_elements=0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                     compression=topk),
                  loss="mse", jit_compile=False)
    model.fit(shard(x, steps), shard(y, steps), batch_size=BATCH, epochs=1,
              shuffle=False, verbose=0)
    assert_same_on_every_rank(model.get_weights())
    assert_close(model.get_weights(), expected)
    assert topk.bytes_sent > 0      # the kernels went through it, not the allreduce


@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_gradient_tape_with_each_compressor_keeps_ranks_together():
    one_thread()
    steps = 3
    x, y = dataset(steps)
    xs, ys = shard(x, steps), shard(y, steps)
    for make in ("topk", "onebit", "int8", "int4", "powersgd"):
        compressor = getattr(hvd_tf.Compression, make)(min_elements=0) if make != "topk" \
            else hvd_tf.Compression.topk(0.25, min_elements=0)
        model = make_model(0)
        start = model.get_weights()
        optimizer = keras.optimizers.SGD(0.1)

        @tf.function
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(features) - labels) ** 2)
            tape = hvd_tf.DistributedGradientTape(tape, compression=compressor)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        for i in range(steps):
            step(xs[i * BATCH:(i + 1) * BATCH], ys[i * BATCH:(i + 1) * BATCH])
        assert_same_on_every_rank(model.get_weights())
        assert all(not np.array_equal(a, b) for a, b in zip(model.get_weights(), start))
        # Error feedback keeps a residual for the two kernels; biases (1-D) go uncompressed.
        assert len(compressor.residuals) == 2, (make, sorted(compressor.residuals))


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_error_feedback_carries_every_residual_into_the_next_step():
    for make in ("topk", "onebit", "int8", "int4", "powersgd"):
        compressor = getattr(hvd_tf.Compression, make)(min_elements=0) if make != "topk" \
            else hvd_tf.Compression.topk(0.1, min_elements=0)
        gradients = [np.random.default_rng(10 * step + hvd.rank()).standard_normal((12, 10))
                     .astype(np.float32) for step in range(3)]
        sent = np.zeros((12, 10), np.float32)
        for gradient in gradients:
            before = compressor.residuals.get("w", 0)
            _, mine = compressor.exchange(gradient, "w", hvd_tf.global_process_set)
            np.testing.assert_array_equal(compressor.residuals["w"], gradient + before - mine)
            sent += mine
        np.testing.assert_allclose(sent + compressor.residuals["w"], sum(gradients),
                                   rtol=1e-5, atol=1e-5, err_msg=make)


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_a_shape_that_differs_between_ranks_fails_on_every_rank():
    compressor = hvd_tf.Compression.int4(error_feedback=False, min_elements=0)
    with pytest.raises(ValueError, match=r"'w' differs in shape between ranks: "
                                         r"rank 0: \[4, 3\], rank 1: \[4, 4\]"):
        compressor.exchange(np.ones((4, 3 + hvd.rank()), np.float32), "w",
                            hvd_tf.global_process_set)


def topk_and_powersgd():
    """Top-k for the first kernel, PowerSGD for the second, both with error
    feedback; biases uncompressed."""
    topk = hvd.Compression.topk(0.25, min_elements=0)
    powersgd = hvd.Compression.powersgd(1, min_elements=0)
    return topk, powersgd, lambda name, shape: (
        None if len(shape) < 2 else topk if shape[0] == 5 else powersgd)


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_keras_checkpoint_carries_residuals_and_q_and_resumes_like_straight_through():
    one_thread()
    steps = 3
    x, y = dataset(steps)
    xs, ys = shard(x, steps), shard(y, steps)
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    path = os.path.join(directory, "ckpt.npz")

    def compiled(compression):
        model = make_model(0)
        model.compile(optimizer=hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), compression=compression),
            loss="mse", jit_compile=False)
        return model

    def fit(model, first, count):
        rows = slice(first * BATCH, (first + count) * BATCH)
        model.fit(xs[rows], ys[rows], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    topk, powersgd, choose = topk_and_powersgd()
    model = compiled(choose)
    fit(model, 0, 2)
    hvd.save_checkpoint(path, model)
    (residual,) = topk.residuals.values()
    assert np.abs(residual).sum() > 0 and powersgd.compressor.q
    # What resuming loses, as documented: the residuals of the ranks that did not save.
    if hvd.rank() != 0:
        topk.residuals.clear()
        powersgd.residuals.clear()
    fit(model, 2, 1)
    expected = model.get_weights()

    topk, powersgd, choose = topk_and_powersgd()
    resumed = compiled(choose)
    hvd.load_checkpoint(path, resumed)
    fit(resumed, 2, 1)
    for got, want in zip(resumed.get_weights(), expected):
        np.testing.assert_array_equal(got, want)
    assert_same_on_every_rank(resumed.get_weights())

    # The broadcast callback, and broadcast_global_variables(model=), give every
    # rank the root's Q; residuals stay each rank's.
    def on_train_begin(root_rank):
        callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)
        callback.set_model(resumed)
        callback.on_train_begin()

    for broadcast in (on_train_begin,
                      lambda root_rank: hvd.broadcast_global_variables(root_rank,
                                                                       model=resumed)):
        saved_q = powersgd.compressor.q
        (q_key, q), = saved_q.items()
        saved_q[q_key] = q + hvd.rank()
        (key, residual), = topk.residuals.items()
        mine = residual.copy()
        broadcast(0)
        np.testing.assert_array_equal(topk.residuals[key], mine)
        everyone = hvd.allgather_object(saved_q[q_key])
        assert all(np.array_equal(other, q) for other in everyone)
    if hvd.rank() == 0:
        shutil.rmtree(directory)


def test_a_choice_per_variable_that_is_no_compressor_is_refused_by_name():
    from mpitrain.tensorflow.compression import choice
    _, choose = choice.split({"dense/kernel": hvd_tf.Compression.topk(0.5),
                              "dense/bias": hvd_tf.Compression.none})
    assert choose("dense/kernel", (4, 3)) is not None
    assert choose("dense/bias", (3,)) is None
    _, choose = choice.split(lambda name, shape: "fp16")
    with pytest.raises(ValueError, match="compression chose 'fp16' for 'dense/bias': a "
                                         "choice per variable is Compression.topk"):
        choose("dense/bias", (3,))


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_compressors_that_differ_between_ranks_fail_every_rank_naming_each():
    """Eagerly and in a tf.function: other settings garbled the sums (numpy's
    size error); another kind, or none, left the ranks waiting for each other."""
    one_thread()
    x, y = dataset(1)
    features, labels = shard(x, 1), shard(y, 1)
    c = hvd_tf.Compression
    others = "ranks 0, 2" if hvd.size() == 3 else "rank 0"
    for usual, other in ((c.int8(256, min_elements=0), c.int8(512, min_elements=0)),
                         (c.int8(min_elements=0), c.onebit(min_elements=0)),
                         (c.topk(0.1, min_elements=0), c.none)):
        model = make_model(0)
        compression = other if hvd.rank() == 1 else usual

        def gradients():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(features) - labels) ** 2)
            tape = hvd_tf.DistributedGradientTape(tape, compression=compression)
            return tape.gradient(loss, model.trainable_variables)

        rank_1 = "uncompressed" if other is c.none else repr(other)
        expected = (rf"compression=\.\.\.: the compressor of '[\w/]+kernel' differs between "
                    rf"ranks \({others}: {re.escape(repr(usual))}; rank 1: "
                    rf"{re.escape(rank_1)}\): every rank must use the same")
        for run, error in ((gradients, hvd_tf.MismatchError),
                           (tf.function(gradients), tf.errors.UnknownError)):
            with pytest.raises(error, match=expected):
                run()
