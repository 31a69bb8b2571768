"""mpitrain.tensorflow's broadcasts on a process set take root_rank as a
rank of the job, as Horovod does (numpy's are in tests/test_process_sets.py)."""

import numpy as np
import pytest

from tests.mpi_harness import mpi_test, on_a_new_process_set

tf = pytest.importorskip("tensorflow")

import mpitrain.tensorflow as hvd

OUTSIDER = r"root_rank 0 is not a member of the process set, whose ranks are \[1, 2\]"


def on_the_set_of_ranks_1_and_2(r, upper):
    x = tf.Variable([float(r), float(r)])
    with tf.GradientTape() as tape:
        got = hvd.broadcast(x, root_rank=2, process_set=upper)
        loss = tf.reduce_sum(got)
    assert got.numpy().tolist() == [2.0, 2.0]
    # the root's input gets the average of the members' gradients (Horovod's
    # convention), the other none
    assert tape.gradient(loss, x).numpy().tolist() == ([1.0, 1.0] if r == 2 else [0.0, 0.0])
    in_a_graph = tf.function(lambda: hvd.broadcast(x, 1, name="graph", process_set=upper))
    assert in_a_graph().numpy().tolist() == [1.0, 1.0]
    variables = [tf.Variable([float(r)]), tf.Variable([[float(r)] * 2])]
    hvd.broadcast_variables(variables, root_rank=2, process_set=upper)
    assert [v.numpy().tolist() for v in variables] == [[2.0], [[2.0, 2.0]]]
    assert hvd.broadcast_object({"from": r}, root_rank=2, process_set=upper) == {"from": 2}

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"broadcast of 'outsider\w*' failed.*{OUTSIDER}"):
        hvd.broadcast(x, root_rank=0, name="outsider", process_set=upper)
    with pytest.raises(tf.errors.InvalidArgumentError, match=OUTSIDER):
        hvd.broadcast_variables(variables, root_rank=0, process_set=upper)
    with pytest.raises(ValueError, match=OUTSIDER):
        hvd.broadcast_object("epoch 1", root_rank=0, process_set=upper)
    assert hvd.allreduce(tf.ones([1]), op=hvd.Sum, process_set=upper).numpy()[0] == 2


@mpi_test(np=(3,), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120)
def test_on_a_set_root_rank_is_a_rank_of_the_job():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    on_a_new_process_set((1, 2), on_the_set_of_ranks_1_and_2)



@mpi_test(np=(3,), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=120)
def test_a_root_outside_the_optimizers_set_gives_its_members_one_q():
    """PowerSGD's Q is mpitrain's own state, which BroadcastGlobalVariablesCallback
    and broadcast_global_variables(model=) share: with root_rank 0 outside the
    optimizer's set {1, 2}, the members take the set's first member's Q, and
    rank 0, which trains without that optimizer, has none to share."""
    import keras

    import mpitrain.tensorflow.keras as hvd_keras
    from mpitrain.tensorflow.keras.variables import broadcast_compression_state
    from tests.keras_models import make_model
    tf.config.threading.set_intra_op_parallelism_threads(1)
    r = hvd.rank()
    upper = hvd.add_process_set([1, 2])
    try:
        powersgd = hvd_keras.Compression.powersgd(1, min_elements=0)
        optimizer = hvd_keras.DistributedOptimizer(
            keras.optimizers.SGD(0.1), process_set=upper,
            compression=lambda name, shape: powersgd if len(shape) == 2 else None)
        if r in (1, 2):
            model = make_model(0)
            model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
            x = tf.random.stateless_normal([4, 5], seed=[r, 0])
            model.fit(x, tf.zeros([4, 2]), batch_size=4, epochs=1, verbose=0)
        qs = powersgd.compressor.q
        for key in qs:
            qs[key] = qs[key] + r
        if r in (1, 2):
            before = hvd.allgather_object(dict(qs), process_set=upper)
        broadcast_compression_state(optimizer, 0)
        if r in (1, 2):
            first = before[0]
            assert first and set(powersgd.compressor.q) == set(first)
            for key, q in powersgd.compressor.q.items():
                np.testing.assert_array_equal(q, first[key])
    finally:
        hvd.remove_process_set(upper)
