"""mpitrain.tensorflow.keras: training on shards equals training on the whole batch."""

import os
import warnings
import tempfile

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

import mpitrain.tensorflow as hvd_tf  # noqa: E402
import mpitrain.tensorflow.keras as hvd  # noqa: E402
from tests.keras_models import make_model  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
BATCH = 4            # per rank and step


def one_thread():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def dataset(steps):
    rng = np.random.default_rng(7)
    n = hvd.size()
    x = rng.normal(size=(steps * BATCH * n, 5)).astype(np.float32)
    y = rng.normal(size=(steps * BATCH * n, 2)).astype(np.float32)
    return x, y


def shard(array, steps):
    """This rank's part of each global batch: rows [step][rank] of the batch."""
    n, r = hvd.size(), hvd.rank()
    return array.reshape(steps, n, BATCH, -1)[:, r].reshape(steps * BATCH, -1)


def reference_weights(x, y, epochs, optimizer, steps, batch_size=None):
    """One process fitting the whole global batches, from rank 0's initial weights."""
    model = make_model(0)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size or BATCH * hvd.size(), epochs=epochs,
              shuffle=False, verbose=0)
    return model.get_weights()


def assert_same_on_every_rank(weights):
    everyone = hvd.allgather_object([w.tolist() for w in weights])
    assert all(other == everyone[0] for other in everyone), "ranks ended apart"


def assert_close(weights, expected):
    for got, want in zip(weights, expected):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


class RawLogs(keras.callbacks.Callback):
    """Keeps each epoch's logs as this rank computed them, before averaging."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_fit_on_shards_equals_one_process_on_the_whole_batch():
    one_thread()
    steps, epochs = 3, 2
    x, y = dataset(steps)
    model = make_model(hvd.rank())              # ranks start apart on purpose
    plain = keras.optimizers.SGD(0.1, momentum=0.5)
    optimizer = hvd.DistributedOptimizer(plain)
    assert type(optimizer).__name__ == "SGD" and isinstance(optimizer, type(plain))
    assert optimizer.get_config() == plain.get_config()
    model.compile(optimizer=optimizer, loss="mse")
    raw = RawLogs()
    history = model.fit(shard(x, steps), shard(y, steps), batch_size=BATCH, epochs=epochs,
                        shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), raw,
                                   hvd.callbacks.MetricAverageCallback()])
    assert_same_on_every_rank(model.get_weights())
    assert_close(model.get_weights(), reference_weights(
        x, y, epochs, keras.optimizers.SGD(0.1, momentum=0.5), steps))
    # Metrics: each rank logged its shard's loss; after averaging, all log the mean.
    raw_everywhere = np.array(hvd.allgather_object(raw.losses))
    assert not np.allclose(raw_everywhere[0], raw_everywhere[1])
    np.testing.assert_allclose(history.history["loss"], raw_everywhere.mean(axis=0),
                               rtol=1e-6)
    assert int(optimizer.iterations.numpy()) == steps * epochs


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_custom_loop_with_distributed_gradient_tape_eager_and_tf_function():
    one_thread()
    steps = 3
    x, y = dataset(steps)
    xs, ys = shard(x, steps), shard(y, steps)
    expected = reference_weights(x, y, 1, keras.optimizers.SGD(0.1), steps)
    for compiled in (False, True):
        model = make_model(hvd.rank())
        optimizer = keras.optimizers.SGD(0.1)
        hvd.broadcast_variables(model.variables, root_rank=0)

        def train_step(features, labels):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(features) - labels) ** 2)
            tape = hvd_tf.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        step = tf.function(train_step) if compiled else train_step
        for i in range(steps):
            step(xs[i * BATCH:(i + 1) * BATCH], ys[i * BATCH:(i + 1) * BATCH])
        assert_same_on_every_rank(model.get_weights())
        assert_close(model.get_weights(), expected)


@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_backward_passes_per_step_aggregates_locally_then_applies_once():
    one_thread()
    passes, steps = 2, 4
    x, y = dataset(steps)
    model = make_model(0)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                         backward_passes_per_step=passes,
                                         average_aggregated_gradients=True)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(shard(x, steps), shard(y, steps), batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)
    assert int(optimizer.iterations.numpy()) == steps
    # Two passes of BATCH rows on each rank make one global batch of
    # 2 * BATCH * size rows: this rank's rows of steps 0-1, then 2-3.
    n = hvd.size()
    by_step = x.reshape(steps, n, BATCH, 5), y.reshape(steps, n, BATCH, 2)
    ordered = [a.reshape(steps // passes, passes, n, BATCH, -1).transpose(0, 2, 1, 3, 4)
               .reshape(steps * n * BATCH, -1) for a in by_step]
    assert_same_on_every_rank(model.get_weights())
    assert_close(model.get_weights(), reference_weights(
        *ordered, 1, keras.optimizers.SGD(0.1), steps, batch_size=passes * BATCH * n))


@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_loss_scale_optimizer_wrapped_outside_skips_on_every_rank_together():
    one_thread()
    r = hvd.rank()
    variable = keras.Variable(np.ones(3, np.float32))
    inner = keras.optimizers.SGD(1.0)
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.LossScaleOptimizer(inner, initial_scale=8.0))
    assert type(optimizer).__name__ == "LossScaleOptimizer"
    bad = np.array([np.inf, 0, 0], np.float32) if r == 1 else np.zeros(3, np.float32)
    optimizer.apply([tf.constant(bad)], [variable])          # inf on one rank only
    assert variable.numpy().tolist() == [1.0, 1.0, 1.0]
    assert float(optimizer.dynamic_scale.numpy()) == 4.0
    # Scaled gradients 4 * (r + 1): reduced to 4 * mean, unscaled, applied.
    optimizer.apply([tf.fill([3], 4.0 * (r + 1))], [variable])
    n = hvd.size()
    np.testing.assert_allclose(variable.numpy(), 1.0 - (n + 1) / 2)


@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_warmup_and_schedule_callbacks_follow_horovods_formulas():
    one_thread()
    n, steps, warmup = hvd.size(), 3, 2
    x, y = dataset(steps)
    seen = []

    class Recorder(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    history = model.fit(shard(x, steps), shard(y, steps), batch_size=BATCH, epochs=3,
                        shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.LearningRateWarmupCallback(
                            0.4, warmup_epochs=warmup, steps_per_epoch=steps), Recorder()])
    expected = [0.4 / n * ((e + (b + 1) / steps) * (n - 1) / warmup + 1)
                for e in range(warmup) for b in range(steps)]
    expected += [expected[-1]] * steps                    # after the warmup: unchanged
    np.testing.assert_allclose(seen, expected, rtol=1e-6)
    assert abs(expected[warmup * steps - 1] - 0.4) < 1e-7
    np.testing.assert_allclose(history.history["lr"], [expected[steps - 1], 0.4, 0.4],
                               rtol=1e-6)
    seen.clear()
    schedule = hvd.callbacks.LearningRateScheduleCallback(
        0.2, multiplier=lambda epoch: 0.5 ** epoch, start_epoch=1, momentum_correction=False)
    model.fit(shard(x, steps), shard(y, steps), batch_size=BATCH, epochs=3, shuffle=False,
              verbose=0, callbacks=[schedule, Recorder()])
    np.testing.assert_allclose(seen, [0.4] * steps + [0.1] * steps + [0.05] * steps,
                               rtol=1e-6)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(shard(x, steps), shard(y, steps), batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1)])
    skipped = [w for w in caught if "momentum_correction is skipped" in str(w.message)]
    assert bool(skipped) == (hvd.rank() == 0), [str(w.message) for w in caught]


@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_saved_model_reloads_with_a_distributed_optimizer_and_its_state():
    one_thread()
    steps = 2
    x, y = dataset(steps)
    model = make_model(hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    hvd.broadcast_global_variables(0, model=model)
    model.fit(shard(x, steps), shard(y, steps), batch_size=BATCH, verbose=0, shuffle=False)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        model.save(path)
        loaded = hvd.load_model(path)
    assert type(loaded.optimizer).__name__ == "Adam"
    assert getattr(loaded.optimizer, "_mpitrain_distributed", False)
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())
    # Rank 1 trains on other data: only a reducing optimizer keeps ranks equal.
    loaded.fit(shard(x, steps) * (hvd.rank() + 1), shard(y, steps), batch_size=BATCH,
               verbose=0)
    assert_same_on_every_rank(loaded.get_weights())
    with pytest.raises(RuntimeError, match="model=model"):
        hvd.broadcast_global_variables(0)


@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_jit_compiled_fit_is_refused_with_advice():
    one_thread()
    x, y = dataset(1)
    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=True)
    with pytest.raises(Exception, match="jit_compile=False"):
        model.fit(shard(x, 1), shard(y, 1), batch_size=BATCH, verbose=0)


@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_fit_with_embedding_gradients_sparse_and_densified():
    one_thread()
    n, r = hvd.size(), hvd.rank()
    ids = np.random.default_rng(0).integers(0, 50, size=(8 * n, 4))
    y = np.random.default_rng(1).normal(size=(8 * n, 1)).astype(np.float32)
    whole = np.concatenate([np.arange(k, 8 * n, n) for k in range(n)])

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,), dtype="int32"),
                                 keras.layers.Embedding(50, 3), keras.layers.Flatten(),
                                 keras.layers.Dense(1)])
    reference = model()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(ids[whole], y[whole], batch_size=8 * n, epochs=2, shuffle=False, verbose=0)
    for sparse_as_dense in (False, True):
        trained = model()
        trained.compile(optimizer=hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1), sparse_as_dense=sparse_as_dense), loss="mse")
        trained.fit(ids[r::n], y[r::n], batch_size=8, epochs=2, shuffle=False, verbose=0)
        assert_close(trained.get_weights(), reference.get_weights())


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_local_layers_keep_their_own_gradients_in_a_tape_and_in_fit():
    one_thread()
    n = hvd.size()
    x, y = dataset(1)
    xs, ys = shard(x, 1), shard(y, 1)
    model = make_model(0)
    local_layer = model.layers[-1]
    local = [id(v) for v in local_layer.trainable_weights]
    mse = keras.losses.MeanSquaredError()
    with tf.GradientTape() as tape:
        loss = mse(ys, model(xs))
    own = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    everyone = hvd.allgather_object(own)
    expected = [own[i] / n if id(v) in local else
                np.mean([grads[i] for grads in everyone], axis=0)
                for i, v in enumerate(model.trainable_variables)]
    assert not np.allclose(own[-1], everyone[(hvd.rank() + 1) % n][-1])

    with tf.GradientTape() as tape:
        loss = mse(ys, model(xs))
    partial = hvd_tf.PartialDistributedGradientTape(tape, local_layers=[local_layer])
    assert_close([g.numpy() for g in partial.gradient(loss, model.trainable_variables)],
                 expected)

    before = [v.numpy() for v in model.trainable_variables]
    optimizer = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                local_layers=local_layer)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(xs, ys, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_close([v.numpy() for v in model.trainable_variables],
                 [w - 0.1 * g for w, g in zip(before, expected)])
    with pytest.raises(ValueError, match="local_layers must be Keras layers"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=["dense"])


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_tensorflow_distributed_optimizer_wraps_tf1_optimizers_and_hands_on_keras_ones():
    one_thread()
    steps, n = 3, hvd.size()
    x, y = dataset(steps)
    xs, ys = shard(x, steps), shard(y, steps)

    def train(optimizer, features, labels, rows, compiled):
        """A linear model of tf.Variables, as TF1-style code has it."""
        w = tf.Variable(np.random.default_rng(0).normal(size=(5, 2)).astype(np.float32))
        b = tf.Variable(tf.zeros([2]))

        def step(f, l):
            optimizer.minimize(lambda: tf.reduce_mean((f @ w + b - l) ** 2), var_list=[w, b])
        step = tf.function(step) if compiled else step
        for i in range(steps):
            step(features[i * rows:(i + 1) * rows], labels[i * rows:(i + 1) * rows])
        return [w.numpy(), b.numpy()]

    expected = train(tf.compat.v1.train.GradientDescentOptimizer(0.1), x, y, BATCH * n,
                     compiled=False)
    for compiled in (False, True):
        optimizer = hvd_tf.DistributedOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1))
        assert isinstance(optimizer, tf.compat.v1.train.Optimizer)
        weights = train(optimizer, xs, ys, BATCH, compiled)
        assert_same_on_every_rank(weights)
        assert_close(weights, expected)
    keras_optimizer = hvd_tf.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert type(keras_optimizer).__name__ == "SGD" and keras_optimizer._mpitrain_distributed
    with pytest.raises(NotImplementedError, match="Keras optimizers only"):
        hvd_tf.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(),
                                    backward_passes_per_step=2)
    with pytest.raises(TypeError, match="is not a Keras optimizer"):
        hvd_tf.DistributedOptimizer(object())


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_sync_batch_normalization_matches_batch_normalization_on_the_whole_batch():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(3)
    # Batches of different sizes per rank, channels on the last axis.
    batches = [rng.normal(2.0, 3.0, size=(k + 2, 3, 4)).astype(np.float32) for k in range(n)]
    upstream = [rng.normal(size=b.shape).astype(np.float32) for b in batches]
    whole = keras.layers.BatchNormalization(momentum=0.5)
    inputs = tf.constant(np.concatenate(batches))
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        loss = tf.reduce_sum(whole(inputs, training=True) * np.concatenate(upstream))
    want_input_grad, want_gamma_grad = tape.gradient(loss, [inputs, whole.gamma])
    mine = slice(sum(len(b) for b in batches[:r]), sum(len(b) for b in batches[:r + 1]))

    for compiled in (False, True):
        layer = hvd_tf.SyncBatchNormalization(momentum=0.5)
        x = tf.constant(batches[r])

        def step():
            with tf.GradientTape() as tape:
                tape.watch(x)
                output = layer(x, training=True)
                loss = tf.reduce_sum(output * upstream[r])
            return (output,) + tuple(tape.gradient(loss, [x, layer.gamma]))
        output, input_grad, gamma_grad = (tf.function(step) if compiled else step)()
        np.testing.assert_allclose(output.numpy(), _normalized(batches, r, whole.epsilon),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(input_grad.numpy(), want_input_grad.numpy()[mine],
                                   rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(sum(hvd.allgather_object(gamma_grad.numpy())),
                                   want_gamma_grad.numpy(), rtol=1e-4)
        np.testing.assert_allclose(layer.moving_mean.numpy(), whole.moving_mean.numpy(),
                                   rtol=1e-5)
        np.testing.assert_allclose(layer.moving_variance.numpy(),
                                   whole.moving_variance.numpy(), rtol=1e-5)
    masks = [rng.random(b.shape[:-1]) > 0.3 for b in batches]
    want = keras.layers.BatchNormalization()(
        inputs, training=True, mask=tf.constant(np.concatenate(masks))).numpy()[mine]
    got = hvd_tf.SyncBatchNormalization()(tf.constant(batches[r]), training=True,
                                          mask=tf.constant(masks[r]))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def _normalized(batches, rank, epsilon):
    everything = np.concatenate(batches).astype(np.float64)
    mean, variance = everything.mean(axis=(0, 1)), everything.var(axis=(0, 1))
    return (batches[rank] - mean) / np.sqrt(variance + epsilon)
