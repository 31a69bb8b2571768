"""mpitrain.tensorflow collectives: eagerly and in tf.function, gradients, errors."""

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")
import mpitrain.tensorflow as hvd  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def one_thread():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def ranked(shape, dtype, rank):
    """Small values every dtype holds exactly, different per rank."""
    count = int(np.prod(shape))
    return tf.constant(((np.arange(count) % 5) + rank + 1).reshape(shape), dtype=dtype)


def both_modes(function):
    """Run ``function`` eagerly and as a tf.function; return both results."""
    return function(), tf.function(function)()


@mpi_test(env=TF_ENV, timeout=120)
def test_allreduce_ops_dtypes_and_compression_eager_and_in_tf_function():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    for dtype in (tf.uint8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32,
                  tf.float64):
        x = ranked((2, 3), dtype, r)
        everyone = [ranked((2, 3), tf.float64, k).numpy() for k in range(n)]
        expected = {hvd.Sum: sum(everyone), hvd.Min: np.minimum.reduce(everyone),
                    hvd.Max: np.maximum.reduce(everyone)}
        for op, want in expected.items():
            for got in both_modes(lambda: hvd.allreduce(x, op=op)):
                assert got.dtype == dtype and got.shape == (2, 3)
                np.testing.assert_array_equal(tf.cast(got, tf.float64).numpy(), want)
    x = tf.fill([4], float(r))
    for got in both_modes(lambda: hvd.allreduce(x)):
        np.testing.assert_allclose(got.numpy(), sum(range(n)) / n)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    np.testing.assert_allclose(got.numpy(), sum(range(n)))
    for compression in (hvd.Compression.fp16, hvd.Compression.bf16):
        for got in both_modes(lambda: hvd.allreduce(x + 0.5, compression=compression)):
            assert got.dtype == tf.float32
            np.testing.assert_allclose(got.numpy(), sum(range(n)) / n + 0.5, rtol=1e-2)


@mpi_test(env=TF_ENV, timeout=120)
def test_other_collectives_eager_and_in_tf_function():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    rows = tf.fill([r + 1, 2], float(r))               # uneven first dimension
    gathered = np.concatenate([np.full((k + 1, 2), float(k)) for k in range(n)])
    for got in both_modes(lambda: hvd.allgather(rows)):
        np.testing.assert_array_equal(got.numpy(), gathered)
    for got_rows, got_ints in both_modes(lambda: hvd.grouped_allgather(
            [rows, tf.constant([r], tf.int64)])):
        np.testing.assert_array_equal(got_rows.numpy(), gathered)
        np.testing.assert_array_equal(got_ints.numpy(), np.arange(n))
    for got in both_modes(lambda: hvd.broadcast(tf.fill([3], r + 1.0), root_rank=n - 1)):
        np.testing.assert_array_equal(got.numpy(), [float(n)] * 3)
    for a, b in both_modes(lambda: hvd.grouped_allreduce(
            [tf.fill([2], float(r)), tf.fill([5], r * 2.0)], op=hvd.Sum)):
        np.testing.assert_array_equal(a.numpy(), [sum(range(n))] * 2)
        np.testing.assert_array_equal(b.numpy(), [2 * sum(range(n))] * 5)
    # alltoall: rank r sends k + 1 rows of value 10 * r + k to rank k
    splits = tf.constant([k + 1 for k in range(n)], tf.int32)
    values = tf.constant(np.concatenate([np.full(k + 1, 10 * r + k) for k in range(n)]),
                         tf.float32)
    for out, received in both_modes(lambda: hvd.alltoall(values, splits)):
        np.testing.assert_array_equal(out.numpy(), [10 * k + r for k in range(n)
                                                    for _ in range(r + 1)])
        np.testing.assert_array_equal(received.numpy(), [r + 1] * n)
    block = tf.fill([2 * n + 1, 3], float(r + 1))
    mine = 3 if r == 0 else 2                           # the lowest rank gets the extra row
    for got in both_modes(lambda: hvd.reducescatter(block, op=hvd.Sum)):
        np.testing.assert_array_equal(got.numpy(), np.full((mine, 3), n * (n + 1) / 2))
    for a, b in both_modes(lambda: hvd.grouped_reducescatter([block, block * 2])):
        np.testing.assert_allclose(a.numpy(), np.full((mine, 3), (n + 1) / 2))
        np.testing.assert_allclose(b.numpy(), np.full((mine, 3), n + 1.0))


@mpi_test(env=TF_ENV, timeout=120)
def test_one_op_per_collective_call_and_stable_names_across_steps():
    one_thread()
    grads = [tf.fill([k + 2], 1.0) for k in range(4)]

    @tf.function
    def step(grads):
        return hvd.grouped_allreduce(grads, op=hvd.Sum), hvd.allgather(grads[0])

    graph = step.get_concrete_function(grads).graph
    python_ops = [op for op in graph.get_operations() if op.type == "PyFunc"]
    assert len(python_ops) == 2
    for _ in range(3):                                   # same names each step
        reduced, _ = step(grads)
        np.testing.assert_array_equal(reduced[3].numpy(), [hvd.size()] * 5)


@mpi_test(env=TF_ENV, timeout=120)
def test_gradients_of_the_collectives():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    x = tf.Variable(tf.fill([r + 1, 2], r + 1.0))
    weights = tf.constant([[1.0], [2.0]])
    with tf.GradientTape(persistent=True) as tape:
        reduced = hvd.allreduce(x[:1] * 3.0, op=hvd.Sum)
        gathered = hvd.allgather(x)
        broadcast = hvd.broadcast(x[:1], root_rank=0)
        scattered = hvd.reducescatter(tf.tile(x[:1], [n, 1]), op=hvd.Average)
        losses = [tf.reduce_sum(reduced), tf.reduce_sum(gathered @ weights),
                  tf.reduce_sum(broadcast), tf.reduce_sum(scattered)]
    got = [tape.gradient(loss, x).numpy() for loss in losses]
    first_row = np.zeros((r + 1, 2)), np.s_[:1]
    # allreduce: the gradient is the allreduce (Sum) of 3 from every rank
    want = first_row[0].copy(); want[first_row[1]] = 3.0 * n
    np.testing.assert_allclose(got[0], want)
    # allgather and broadcast, as Horovod: the gradient of the ranks' average
    # loss. Every rank's loss depends on every row, with weights [1, 2]:
    np.testing.assert_allclose(got[1], np.tile([[1.0, 2.0]], (r + 1, 1)) * n / n)
    # broadcast: only the root's input reaches the outputs, from every rank
    want = first_row[0].copy(); want[first_row[1]] = n / n if r == 0 else 0.0
    np.testing.assert_allclose(got[2], want)
    # reducescatter (Average), unlike Horovod (n times this): the gradient of the
    # ranks' summed loss; each tiled row contributes 1/n to one rank's output
    want = first_row[0].copy(); want[first_row[1]] = 1.0
    np.testing.assert_allclose(got[3], want)
    values = tf.Variable(tf.fill([2 * n], float(r)))
    with tf.GradientTape() as tape:
        out = hvd.alltoall(values * tf.range(1.0, 2 * n + 1))
        loss = tf.reduce_sum(out)
    np.testing.assert_allclose(tape.gradient(loss, values).numpy(), np.arange(1, 2 * n + 1))


@mpi_test(env=TF_ENV, timeout=120)
def test_embedding_gradients_as_indexed_slices_and_sparse_as_dense():
    one_thread()
    import keras
    r, n = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(1)
    embedding = keras.layers.Embedding(10, 3)
    ids = tf.constant([[r, 5]])
    for sparse_as_dense in (False, True):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(embedding(ids))
        local = tape.gradient(loss, embedding.trainable_variables)[0]
        assert isinstance(local, tf.IndexedSlices)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        (got,) = tape.gradient(loss, embedding.trainable_variables)
        assert isinstance(got, tf.IndexedSlices) != sparse_as_dense
        want = np.zeros((10, 3))
        for k in range(n):
            want[k] += 1.0 / n
            want[5] += 1.0 / n
        np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), want, rtol=1e-6)
    # A local source's slices stay this rank's, divided by the size (Horovod's
    # scale_local_gradients; its test_model_parallel_model).
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(embedding(ids))
    local = tf.convert_to_tensor(tape.gradient(loss, embedding.embeddings)).numpy()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(embedding(ids))
    tape = hvd.DistributedGradientTape(tape)
    tape.register_local_source(embedding.embeddings)
    (got,) = tape.gradient(loss, embedding.trainable_variables)
    assert isinstance(got, tf.IndexedSlices)
    np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), local / n, rtol=1e-6)
    slices = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]), tf.constant([10, 3]))
    summed = hvd.allreduce(slices, op=hvd.Sum)
    np.testing.assert_array_equal(tf.convert_to_tensor(summed).numpy()[:n], np.ones((n, 3)))
    for bad in (dict(op=hvd.Max), dict(op=hvd.Sum, prescale_factor=2.0)):
        with pytest.raises(NotImplementedError, match="IndexedSlices"):
            hvd.allreduce(slices, **bad)
    # As Horovod, a group with slices is refused before its dense members travel
    # (integers, which Adasum would refuse with a TypeError of its own).
    with pytest.raises(NotImplementedError, match="IndexedSlices"):
        hvd.grouped_allreduce([tf.ones([4], tf.int32), slices], op=hvd.Adasum)


@mpi_test(env=TF_ENV, timeout=120)
def test_broadcast_variables_and_objects():
    one_thread()
    import keras
    r, n = hvd.rank(), hvd.size()
    variables = [tf.Variable(tf.fill([3], float(r))), tf.Variable(r, dtype=tf.int64),
                 tf.Variable([r % 2 == 0, True]), keras.Variable(np.full(2, r, np.float32)),
                 tf.Variable(np.full(2, r, np.uint32))]
    hvd.broadcast_variables(variables, root_rank=1)
    assert variables[0].numpy().tolist() == [1.0] * 3 and int(variables[1].numpy()) == 1
    assert variables[2].numpy().tolist() == [False, True]
    assert variables[3].numpy().tolist() == [1.0, 1.0]
    assert variables[4].numpy().tolist() == [1, 1]
    in_place = [tf.Variable(tf.fill([2], float(r)))]
    assert hvd.broadcast_(in_place, root_rank=n - 1)[0].numpy().tolist() == [n - 1.0] * 2
    assert in_place[0].numpy().tolist() == [n - 1.0] * 2
    graph_variable = tf.Variable(tf.fill([2], float(r)))
    tf.function(lambda: hvd.broadcast_variables([graph_variable], root_rank=0))()
    assert graph_variable.numpy().tolist() == [0.0, 0.0]
    assert hvd.broadcast_object({"rank": r}, root_rank=n - 1) == {"rank": n - 1}
    assert hvd.allgather_object(r * 10) == [k * 10 for k in range(n)]


@mpi_test(env=TF_ENV, timeout=120)
def test_errors_map_to_tf_errors_and_name_the_tensor():
    one_thread()
    r = hvd.rank()
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatch") as caught:
        hvd.allreduce(tf.ones([2 + r]), name="uneven.shapes")
    assert "'uneven.shapes'" in str(caught.value)
    assert isinstance(caught.value, hvd.HorovodInternalError)
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatch"):
        hvd.allreduce(tf.ones([2], tf.float32 if r == 0 else tf.float64), name="dtypes")
    with pytest.raises(tf.errors.InvalidArgumentError, match="root_rank"):
        hvd.broadcast(tf.ones([2]), root_rank=hvd.size() + 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="unsupported dtype"):
        hvd.allreduce(tf.ones([2], tf.complex64), name="complex")
    with pytest.raises(ValueError, match="either op= or"):
        hvd.allreduce(tf.ones([2]), average=True, op=hvd.Sum)
    # Inside tf.function TensorFlow decides the class; the message still tells.
    in_graph = tf.function(lambda: hvd.allreduce(tf.ones([2 + r]), name="graph.shapes"))
    with pytest.raises(tf.errors.OpError, match="mismatched shapes") as caught:
        in_graph()
    assert "'graph.shapes'" in str(caught.value)
    bad_root = tf.function(lambda: hvd.broadcast(tf.ones([2]), root_rank=hvd.size() + 3))
    with pytest.raises(tf.errors.InvalidArgumentError, match="root_rank"):
        bad_root()
    xla = tf.function(lambda x: hvd.allreduce(x), jit_compile=True)
    with pytest.raises(hvd.XlaNotSupportedError, match="jit_compile=False"):
        xla(tf.ones([2]))
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy(),
                                  [hvd.size()] * 2)


def tape_gradients_averaged_and_held(shape_a, shape_b):
    """Variables a and b with the tape's gradients of scale * (sum(a) + 2 sum(b)),
    checked eagerly and in tf.function: averaged, and results held across
    later steps untouched. Returns a, b and gradients(scale, sources)."""
    r, n = hvd.rank(), hvd.size()
    a, b = tf.Variable(tf.ones(shape_a)), tf.Variable(tf.ones(shape_b))

    def gradients(scale, sources):
        with tf.GradientTape() as tape:
            loss = scale * (tf.reduce_sum(a) + 2.0 * tf.reduce_sum(b))
        return hvd.DistributedGradientTape(tape).gradient(loss, sources)

    for run in (lambda scale: gradients(scale, [a, b]),
                tf.function(lambda scale: gradients(scale, [a, b]))):
        held = [run(tf.constant(float(r + 1))) for _ in range(3)]   # all kept alive
        later = run(tf.constant(10.0 * (r + 1)))
        for ga, gb in held:                 # earlier results untouched by later steps
            np.testing.assert_allclose(ga.numpy(), np.full(shape_a, (n + 1) / 2))
            np.testing.assert_allclose(gb.numpy(), np.full(shape_b, n + 1.0))
        np.testing.assert_allclose(later[0].numpy(), np.full(shape_a, 5.0 * (n + 1)))
        np.testing.assert_allclose(later[1].numpy(), np.full(shape_b, 10.0 * (n + 1)))
    return a, b, gradients


@mpi_test(env=TF_ENV, timeout=120)
def test_tape_gradients_stay_valid_and_layout_mismatch_is_an_error_everywhere():
    one_thread()
    r, n = hvd.rank(), hvd.size()
    a, b, gradients = tape_gradients_averaged_and_held((2, 3), (6,))
    with tf.GradientTape() as tape:
        loss = float(r + 1) * (tf.reduce_sum(a) + 2.0 * tf.reduce_sum(b))
    options = dict(groups=[[b]], compression=hvd.Compression.fp16, op=hvd.Sum,
                   gradient_predivide_factor=1.0)
    ga, gb = hvd.DistributedGradientTape(tape, **options).gradient(loss, [a, b])
    assert ga.dtype == gb.dtype == tf.float32
    np.testing.assert_allclose(ga.numpy(), np.full((2, 3), n * (n + 1) / 2))
    np.testing.assert_allclose(gb.numpy(), np.full(6, n * (n + 1.0)))
    with tf.GradientTape() as tape:
        loss = float(r + 1) * (tf.reduce_sum(a) + 2.0 * tf.reduce_sum(b))
    distributed = hvd.DistributedGradientTape(tape)
    distributed.register_local_source(b)
    ga, gb = distributed.gradient(loss, [a, b])
    np.testing.assert_allclose(ga.numpy(), np.full((2, 3), (n + 1) / 2))
    np.testing.assert_allclose(gb.numpy(), np.full(6, 2.0 * (r + 1) / n))  # local, scaled
    # Same sizes, other order on rank 1: the packed buffers would line up
    # unrelated gradients; every rank must refuse, naming every rank's shapes.
    sources = [a, b] if r != 1 else [b, a]
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatched gradient shapes"
                       ) as caught:
        gradients(1.0, sources)
    assert "rank 0: [(2, 3), (6,)]" in str(caught.value)
    assert "rank 1: [(6,), (2, 3)]" in str(caught.value)


@mpi_test(env=TF_ENV, timeout=120)
def test_integer_averages_and_nan_maxima_through_tensorflow():
    r = hvd.rank()
    averaged = hvd.allreduce(tf.constant([100, -100, 127], tf.int8), name="tf.int8.avg")
    assert averaged.dtype == tf.int8 and averaged.numpy().tolist() == [100, -100, 127]
    x = tf.constant([float("nan") if r == 1 else 1.0, 2.0])
    top = hvd.allreduce(x, op=hvd.Max, name="tf.nan.max")
    assert np.isnan(top.numpy()[0]) and top.numpy()[1] == 2.0


@mpi_test(env=TF_ENV, timeout=120)
def test_gradients_large_enough_to_stream_average_and_stay_valid_when_held():
    """Past 256 KiB the gradients go as a grouped allreduce streamed through
    shared memory instead of a packed buffer: the values, results held across
    steps, and a layout that differs between ranks must behave the same."""
    one_thread()
    a, b, gradients = tape_gradients_averaged_and_held((256, 300), (70000,))
    sources = [a, b] if hvd.rank() != 1 else [b, a]
    with pytest.raises(tf.errors.OpError, match="shape") as caught:
        gradients(1.0, sources)
    assert "(256, 300)" in str(caught.value) and "(70000,)" in str(caught.value)
