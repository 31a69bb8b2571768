"""Collectives in TF1 graphs run by a session, as Horovod's own tests run each
test a second time: in any order the ranks' executors start them, in-place
broadcasts, the rank and size ops, and errors."""

import numpy as np
import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")
import mpitrain.tensorflow as hvd  # noqa: E402

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def session():
    """A session whose executor runs one op at a time, in the order the ops
    became ready: on this graph, the order they were made in."""
    return tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=1, intra_op_parallelism_threads=1))


@mpi_test(env=TF_ENV, timeout=180)
def test_collectives_fetched_together_complete_whatever_order_each_rank_starts_them():
    r, n = hvd.rank(), hvd.size()
    kinds = ["allreduce", "allgather", "broadcast", "reducescatter", "alltoall"] * 2
    made = {}
    with tf.Graph().as_default():
        # Odd ranks make (and so start) the named collectives in reverse order.
        for i in (range(len(kinds)) if r % 2 == 0 else reversed(range(len(kinds)))):
            value = tf.constant(np.full((2 * n, 3), float(r + 10 * i)))
            made[i] = {
                "allreduce": lambda: hvd.allreduce(value, op=hvd.Sum, name=f"c{i}"),
                "allgather": lambda: hvd.allgather(value[:r + 1], name=f"c{i}"),
                "broadcast": lambda: hvd.broadcast(value, root_rank=n - 1, name=f"c{i}"),
                "reducescatter": lambda: hvd.reducescatter(value, op=hvd.Sum,
                                                           name=f"c{i}"),
                "alltoall": lambda: hvd.alltoall(value, name=f"c{i}"),
            }[kinds[i]]()
        with session() as running:
            got = running.run([made[i] for i in range(len(kinds))])
    for i, kind in enumerate(kinds):
        of = [np.full((2 * n, 3), float(k + 10 * i)) for k in range(n)]
        want = {"allreduce": sum(of),
                "allgather": np.concatenate([of[k][:k + 1] for k in range(n)]),
                "broadcast": of[n - 1],
                "reducescatter": sum(of)[2 * r:2 * r + 2],
                "alltoall": np.concatenate([of[k][2 * r:2 * r + 2] for k in range(n)])}
        np.testing.assert_array_equal(got[i], want[kind], err_msg=f"{kind} c{i}")


@mpi_test(env=TF_ENV, timeout=120)
def test_in_place_broadcast_in_a_graph_returns_and_holds_the_roots_values():
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        resource = tf.compat.v1.Variable(np.full(3, float(r)), use_resource=True)
        reference = tf.compat.v1.Variable(np.full((2, 2), r), use_resource=False)
        flags = tf.compat.v1.Variable([r % 2 == 1, True])
        returned = hvd.broadcast_([resource, reference, flags], root_rank=n - 1)
        with session() as running:
            running.run(tf.compat.v1.global_variables_initializer())
            got = running.run(returned)
            held = running.run([resource, reference, flags])
    want = [np.full(3, float(n - 1)), np.full((2, 2), n - 1), [(n - 1) % 2 == 1, True]]
    for values in (got, held):
        for value, expected in zip(values, want):
            np.testing.assert_array_equal(value, expected)


@mpi_test(env=TF_ENV, timeout=120)
def test_rank_and_size_ops_and_broadcast_global_variables():
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        weights = tf.compat.v1.Variable(np.full(2, float(r)))
        assign = hvd.broadcast_global_variables(root_rank=0)
        ops = [hvd.rank_op(), hvd.local_rank_op(), hvd.size_op(), hvd.local_size_op(),
               hvd.process_set_included_op()]
        with session() as running:
            running.run(tf.compat.v1.global_variables_initializer())
            running.run(assign)
            assert running.run(weights).tolist() == [0.0, 0.0]
            assert running.run(ops) == [r, hvd.local_rank(), n, hvd.local_size(), 1]
    assert all(op.dtype == tf.int32 for op in ops)
    with pytest.raises(ValueError, match="no process set with id 7"):
        hvd.size_op(process_set_id=7)
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_global_variables(root_rank=0)


@mpi_test(env=TF_ENV, timeout=120)
def test_a_mismatch_in_a_graph_fails_every_rank_with_mpitrains_message():
    # TensorFlow makes any other exception of a Python op an UnknownError: a
    # Python op cannot raise Horovod's FailedPreconditionError in a graph
    # (docs/migrating-from-horovod.md).
    r = hvd.rank()
    with tf.Graph().as_default():
        uneven = hvd.allreduce(tf.ones([2 + r]), name="uneven.shapes")
        with session() as running:
            with pytest.raises(tf.errors.UnknownError, match="mismatch") as caught:
                running.run(uneven)
            assert running.run(hvd.allreduce(tf.ones([2]), op=hvd.Sum)).tolist() == \
                [hvd.size()] * 2
    assert "'uneven.shapes'" in str(caught.value)


@mpi_test(env=TF_ENV, timeout=120)
def test_gradients_in_a_graph_run_the_backward_collectives_on_every_rank():
    # A rank whose broadcast gradient is zeros still takes part in the allreduce
    # the root's gradient needs (Horovod's test_horovod_broadcast_grad_cpu).
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        x = tf.fill([3], float(r))
        grads = [tf.gradients(hvd.broadcast(x, root), x, tf.fill([3], r + 1.0))[0]
                 for root in range(n)]
        with session() as running:
            for root, got in enumerate(running.run(grads)):
                average = sum(k + 1.0 for k in range(n)) / n
                assert got.tolist() == [average if r == root else 0.0] * 3
