"""op=Adasum: every rank's result matches Horovod's tree, computed here in one process.

Each rank builds every rank's input from a seed, so it can compute the
reference itself: pairs (0, 1), (2, 3), ... combined, then pairs of those,
each tensor with its own dot product and norms, in float64.
"""

import ml_dtypes
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.errors import CollectiveNotImplementedError, CollectiveTypeError
from tests.mpi_harness import mpi_test


def adasum_pair(a, b):
    dot = a @ b
    a_coefficient = 1 - dot / (2 * (a @ a)) if a @ a > 0 else 1.0
    b_coefficient = 1 - dot / (2 * (b @ b)) if b @ b > 0 else 1.0
    return a_coefficient * a + b_coefficient * b


def reference(vectors):
    """Adasum of one tensor's vectors, one per rank, in Horovod's tree."""
    level = [np.asarray(v, np.float64).reshape(-1) for v in vectors]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def inputs_of(rank, shape, seed, dtype=np.float64):
    """A rank's input: a direction shared by all ranks plus its own part, so
    that Adasum differs from both the sum and the average."""
    shared = np.random.default_rng(seed).standard_normal(shape)
    own = np.random.default_rng(seed * 1000 + rank + 1).standard_normal(shape)
    return (shared + own * (1 + rank)).astype(dtype)


def expected(shape, seed, ranks, dtype=np.float64):
    """The reference for the ranks (of a set) ranks, whose inputs are rounded as sent."""
    vectors = [inputs_of(r, shape, seed, dtype).astype(np.float64) for r in ranks]
    return reference(vectors).reshape(shape)


def assert_matches(result, shape, seed, ranks, dtype, rtol):
    want = expected(shape, seed, ranks, dtype)
    assert result.dtype == np.dtype(dtype) and result.shape == tuple(shape)
    np.testing.assert_allclose(result.astype(np.float64), want, rtol=rtol,
                               atol=rtol * np.abs(want).max(initial=1.0))


@mpi_test(np=(2, 4), timeout=60)
def test_single_tensors_match_the_reference():
    ranks = range(mt.size())
    for seed, shape in enumerate([(1,), (7,), (3, 5), (2001,), (600, 700)], start=1):
        for dtype, rtol in ((np.float64, 1e-12), (np.float32, 1e-5)):
            mine = inputs_of(mt.rank(), shape, seed, dtype)
            result = mt.allreduce(mine, op=mt.Adasum, name=f"single.{seed}.{dtype.__name__}")
            assert_matches(result, shape, seed, ranks, dtype, rtol)
            if len(result.reshape(-1)) > 1:     # of two numbers, Adasum is their mean
                total = sum(inputs_of(r, shape, seed) for r in ranks)
                assert not np.allclose(result, total, rtol=1e-3)
                assert not np.allclose(result, total / mt.size(), rtol=1e-3)
    mine = inputs_of(mt.rank(), (9,), 50)
    scaled = mt.allreduce(mine, op=mt.Adasum, prescale_factor=0.5, postscale_factor=3.0,
                          name="scaled")
    np.testing.assert_allclose(scaled, 1.5 * expected((9,), 50, ranks), rtol=1e-12)
    in_place = inputs_of(mt.rank(), (33,), 51)
    mt.synchronize(mt.allreduce_async(in_place, op=mt.Adasum, name="in.place",
                                      output=in_place))
    assert_matches(in_place, (33,), 51, ranks, np.float64, 1e-12)


@mpi_test(np=(2, 4), timeout=60)
def test_fused_tensors_each_use_their_own_dot_product():
    """Several tensors of different sizes reduced together, as one fused
    buffer: each matches its own reference, not that of the whole buffer."""
    ranks = range(mt.size())
    shapes = [(5,), (1000,), (3, 4), (1,), (257,)]
    for dtype, rtol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        arrays = [inputs_of(mt.rank(), shape, 10 + i, dtype) for i, shape in enumerate(shapes)]
        arrays[3] *= 0 if mt.rank() == 0 else 1          # a zero norm on one rank
        results = mt.grouped_allreduce(arrays, op=mt.Adasum, name=f"fused.{dtype.__name__}")
        for i, (shape, result) in enumerate(zip(shapes, results)):
            if i == 3:
                vectors = [np.zeros(1)] + [inputs_of(r, shape, 13, dtype) for r in ranks][1:]
                np.testing.assert_allclose(result, reference(vectors), rtol=rtol)
            else:
                assert_matches(result, shape, 10 + i, ranks, dtype, rtol)
        handles = [mt.allreduce_async(array, op=mt.Adasum, name=f"async.{i}.{dtype.__name__}")
                   for i, array in enumerate(arrays) if i != 3]
        for i, handle in zip([0, 1, 2, 4], handles):
            assert_matches(mt.synchronize(handle), shapes[i], 10 + i, ranks, dtype, rtol)


@mpi_test(np=(2, 4), timeout=60)
def test_half_precision_inputs():
    """float16 and bfloat16 are combined in float32 and rounded once."""
    ranks = range(mt.size())
    for dtype in (np.float16, ml_dtypes.bfloat16):
        step = float(ml_dtypes.finfo(dtype).eps)
        arrays = [inputs_of(mt.rank(), shape, 20 + i, dtype)
                  for i, shape in enumerate([(300,), (17,)])]
        results = mt.grouped_allreduce(arrays, op=mt.Adasum, name=f"half.{dtype.__name__}")
        for i, (array, result) in enumerate(zip(arrays, results)):
            assert_matches(result, array.shape, 20 + i, ranks, dtype, rtol=2 * step)


@mpi_test(np=(2, 4), timeout=60)
def test_a_joined_rank_contributes_zeros():
    """Rank 1 joins at once; Adasum of a vector and zeros is that vector."""
    if mt.rank() != 1:
        result = mt.allreduce(inputs_of(mt.rank(), (50,), 90), op=mt.Adasum, name="joined")
        vectors = [np.zeros(50) if r == 1 else inputs_of(r, (50,), 90)
                   for r in range(mt.size())]
        np.testing.assert_allclose(result, reference(vectors), rtol=1e-12)
    mt.join()


@mpi_test(np=(4,), timeout=60)
def test_process_set_uses_its_own_ranks():
    members = [1, 3]
    subset = mt.add_process_set(members)
    if mt.rank() in members:
        mine = inputs_of(members.index(mt.rank()), (40,), 30)
        result = mt.allreduce(mine, op=mt.Adasum, name="subset", process_set=subset)
        assert_matches(result, (40,), 30, range(len(members)), np.float64, 1e-12)
    mt.remove_process_set(subset)


@mpi_test(np=(4,), timeout=60)
def test_the_tree_alone_on_blocking_and_nonblocking_channels():
    """The transport without the engine: other process sets' channels never
    block, and with 4 ranks the tree has two levels to sum norms over."""
    from mpi4py import MPI
    from mpitrain.transport import adasum
    from mpitrain.transport.channel import Channel

    counts = [7, 0, 300, 1]
    for blocking in (True, False):
        comm = MPI.COMM_WORLD.Dup()
        channel = Channel(comm, blocking, chunk_size=1 << 20)
        parts = [inputs_of(comm.rank, (count,), 80 + i) for i, count in enumerate(counts)]
        buffer = np.concatenate(parts)
        for requests in adasum.allreduce(channel, buffer, counts):
            MPI.Request.Waitall(requests if isinstance(requests, list) else [requests])
        want = np.concatenate([expected((count,), 80 + i, range(comm.size))
                               for i, count in enumerate(counts)])
        np.testing.assert_allclose(buffer, want, rtol=1e-12, err_msg=f"blocking={blocking}")
        comm.Free()


@mpi_test(np=(2,), timeout=60)
def test_integers_are_refused_on_every_rank():
    with pytest.raises(CollectiveTypeError, match="op=Adasum combines floating-point "
                                                     "tensors.*got int32"):
        mt.allreduce(np.arange(4, dtype=np.int32), op=mt.Adasum, name="integers")
    assert mt.allreduce(np.ones(2), op=mt.Sum, name="after.integers")[0] == mt.size()


@mpi_test(np=(3,), timeout=60)
def test_three_ranks_fail_on_every_rank_and_the_engine_goes_on():
    with pytest.raises(CollectiveNotImplementedError,
                       match=r"power-of-two number of ranks.*has 3: run 2 or 4 ranks"):
        mt.allreduce(np.ones(4), op=mt.Adasum, name="three")
    assert mt.allreduce(np.ones(2), op=mt.Sum, name="after.three")[0] == 3

    import torch
    import mpitrain.torch as hvd
    model = torch_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         op=hvd.Adasum)
    x, y = torch_batch(mt.rank(), 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(CollectiveNotImplementedError, match="has 3"):
        optimizer.step()
    for p, b in zip(model.parameters(), before):      # no step rather than half of one
        assert torch.equal(p, b)

    pair = mt.add_process_set([0, 1])
    if mt.rank() < 2:
        mine = inputs_of(mt.rank(), (12,), 40)
        result = mt.allreduce(mine, op=mt.Adasum, name="pair", process_set=pair)
        assert_matches(result, (12,), 40, range(2), np.float64, 1e-12)
    mt.remove_process_set(pair)


@mpi_test(np=(2, 4), timeout=60)
def test_torch_tensors():
    import torch
    import mpitrain.torch as hvd

    ranks = range(hvd.size())
    mine = torch.from_numpy(inputs_of(hvd.rank(), (64,), 60, np.float32))
    result = hvd.allreduce(mine, op=hvd.Adasum, name="torch.float32")
    assert_matches(result.numpy(), (64,), 60, ranks, np.float32, 1e-5)
    half = mine.to(torch.bfloat16)
    hvd.allreduce_(half, op=hvd.Adasum, name="torch.bfloat16")
    want = expected((64,), 60, ranks, np.float32)
    np.testing.assert_allclose(half.float().numpy(), want, rtol=0.02,
                               atol=0.02 * np.abs(want).max())


def torch_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 2))


def torch_batch(rank, step):
    import torch
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


@mpi_test(np=(2, 4), timeout=60)
def test_torch_optimizer_combines_each_ranks_step():
    """Adam's first steps are about lr * sign(gradient): combining the steps
    (Horovod's delta optimizer) differs from stepping on combined gradients."""
    import torch
    import mpitrain.torch as hvd

    torch.set_num_threads(1)
    n = hvd.size()
    model = torch_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         op=hvd.Adasum)
    assert isinstance(optimizer, torch.optim.Adam)
    # Every rank replays every rank's local step, each with its own Adam state.
    replicas = [torch_model() for _ in range(n)]
    local = [torch.optim.Adam(m.parameters(), lr=0.1) for m in replicas]
    for step in range(2):
        deltas = []
        for r, (replica, replica_optimizer) in enumerate(zip(replicas, local)):
            replica.load_state_dict(model.state_dict())
            x, y = torch_batch(r, step)
            replica_optimizer.zero_grad()
            torch.nn.functional.mse_loss(replica(x), y).backward()
            replica_optimizer.step()
            deltas.append([(q - p).detach().numpy().astype(np.float64)
                           for p, q in zip(model.parameters(), replica.parameters())])
        want = [p.detach().numpy() + reference([d[i] for d in deltas]).reshape(p.shape)
                for i, p in enumerate(model.parameters())]
        x, y = torch_batch(hvd.rank(), step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        for (name, p), w in zip(model.named_parameters(), want):
            np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step}: {name}")
    # The changes may travel as float16 (Horovod's example does so with Adasum).
    compressed = torch_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(compressed.parameters(), lr=0.1), op=hvd.Adasum,
        named_parameters=[(f"fp16.{name}", p) for name, p in compressed.named_parameters()],
        compression=hvd.Compression.fp16)
    changes = []
    for r, replica in enumerate(replicas):
        replica.load_state_dict(compressed.state_dict())
        replica.zero_grad()
        torch.nn.functional.mse_loss(replica(torch_batch(r, 0)[0]), torch_batch(r, 0)[1]).backward()
        changes.append([-0.1 * p.grad.numpy().astype(np.float16).astype(np.float64)
                        for p in replica.parameters()])
    want = [p.detach().numpy() + reference([c[i] for c in changes]).reshape(p.shape)
            for i, p in enumerate(compressed.parameters())]
    x, y = torch_batch(hvd.rank(), 0)
    torch.nn.functional.mse_loss(compressed(x), y).backward()
    optimizer.step()
    for p, w in zip(compressed.parameters(), want):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 op=hvd.Adasum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="Compression.none, .fp16 or .bf16"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 op=hvd.Adasum, compression=hvd.Compression.topk(0.1))
    # Refused on rank 1 only: the others fail too, naming it, instead of
    # waiting in their first step for a rank that never comes.
    last = hvd.size() - 1
    with pytest.raises(ValueError, match=(r"Compression.none, .fp16 or .bf16" if hvd.rank() == last
                                          else rf"op=Adasum\) failed on rank {last}: ValueError")):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
            compression=hvd.Compression.topk(0.1) if hvd.rank() == last else hvd.Compression.none)
    with pytest.raises(hvd.MismatchError, match=r"op=Adasum\): compression differs between"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
            compression=hvd.Compression.fp16 if hvd.rank() == last else hvd.Compression.none)


@mpi_test(np=(2,), timeout=60)       # the 4-rank tree is the core's: tested above
def test_tensorflow_tape_and_keras_optimizer_combine_gradients():
    import keras
    import tensorflow as tf
    import mpitrain.tensorflow as hvd_tf
    import mpitrain.tensorflow.keras as hvd_keras

    ranks = range(mt.size())
    start = [np.arange(6, dtype=np.float32).reshape(2, 3) / 10, np.ones(3, np.float32)]

    def gradients_of(rank):
        """The gradients of rank ``rank``'s loss at ``start``, in numpy."""
        kernel, bias = (tf.Variable(v) for v in start)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((tf.constant(inputs_of(rank, (4, 2), 70, np.float32))
                                  @ kernel + bias) ** 2)
        return [g.numpy().astype(np.float64) for g in tape.gradient(loss, [kernel, bias])]

    every = [gradients_of(r) for r in ranks]
    want = [reference([g[i] for g in every]).reshape(start[i].shape) for i in range(2)]

    kernel, bias = (tf.Variable(v) for v in start)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((tf.constant(inputs_of(mt.rank(), (4, 2), 70, np.float32))
                              @ kernel + bias) ** 2)
    tape = hvd_tf.DistributedGradientTape(tape, op=hvd_tf.Adasum)
    for got, w in zip(tape.gradient(loss, [kernel, bias]), want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-5)

    optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.5),
                                               op=hvd_keras.Adasum)
    variables = [keras.Variable(v) for v in start]
    optimizer.apply([tf.constant(g, tf.float32) for g in every[mt.rank()]], variables)
    for variable, s, w in zip(variables, start, want):
        np.testing.assert_allclose(variable.numpy(), s - 0.5 * w, rtol=1e-5, atol=1e-6)
