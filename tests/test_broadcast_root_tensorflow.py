"""mpitrain.tensorflow's broadcasts on a process set take root_rank as a
rank of the job, as Horovod does (numpy's are in tests/test_process_sets.py)."""

import pytest

from tests.mpi_harness import mpi_test

tf = pytest.importorskip("tensorflow")

import mpitrain.tensorflow as hvd

OUTSIDER = r"root_rank 0 is not a member of the process set, whose ranks are \[1, 2\]"


def on_the_set_of_ranks_1_and_2(r, upper):
    x = tf.Variable([float(r), float(r)])
    with tf.GradientTape() as tape:
        got = hvd.broadcast(x, root_rank=2, process_set=upper)
        loss = tf.reduce_sum(got)
    assert got.numpy().tolist() == [2.0, 2.0]
    # the root's input gets the sum of the members' gradients, the other none
    assert tape.gradient(loss, x).numpy().tolist() == ([2.0, 2.0] if r == 2 else [0.0, 0.0])
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
    upper = hvd.add_process_set([1, 2])
    try:
        if hvd.rank() in (1, 2):
            on_the_set_of_ranks_1_and_2(hvd.rank(), upper)
    finally:
        hvd.remove_process_set(upper)
