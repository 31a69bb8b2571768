"""allgather and grouped_allgather: concatenation along the first dimension."""

import tensorflow as tf

from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Average, OpType
from mpitrain.tensorflow.primitives import dense, gather, reduce_dense


def _own_rows(gradient, tensor, process_set):
    """This rank's rows of the averaged gradient of a gathered tensor: Horovod's
    convention, the gradient of the ranks' average loss (docs/migrating-from-horovod.md)."""
    # gradient has the gathered shape: every rank's rows.
    averaged = reduce_dense([gradient], Average, 1.0, 1.0, None, process_set)[0]
    first_dims = gather([tf.shape(tensor, out_type=tf.int64)[:1]], None, process_set)[0]
    start = tf.reduce_sum(first_dims[:process_set.rank()])
    return averaged[start:start + first_dims[process_set.rank()]]


def _gather_with_gradient(tensors, name, process_set):
    @tf.custom_gradient
    def gather_all(*inputs):
        def gradient(*upstream):
            return [None if g is None or not x.dtype.is_floating
                    else _own_rows(g, x, process_set)
                    for g, x in zip(upstream, inputs)]
        return gather(list(inputs), name, process_set), gradient
    return gather_all(*tensors)


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """Gather a list of tensors through one op; first dimensions may differ per rank."""
    tensors = dense(list(tensors), OpType.ALLGATHER, name, process_set)
    if not tensors:
        return []
    # Horovod gathers booleans too; they travel as bytes.
    sent = [tf.cast(t, tf.uint8) if t.dtype == tf.bool else t for t in tensors]
    gathered = _gather_with_gradient(sent, name, process_set)
    return [tf.cast(g, tf.bool) if t.dtype == tf.bool else g
            for g, t in zip(gathered, tensors)]


def allgather(tensor, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]
