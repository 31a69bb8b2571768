"""alltoall: rows scattered to every rank by splits, with its gradient."""

import numpy as np
import tensorflow as tf

from mpitrain.api import array_ops
from mpitrain.api.process_sets import global_process_set
from mpitrain.tensorflow import graph_op


def _exchange(tensor, splits, name, process_set):
    name = graph_op.collective_name(name, "alltoall")

    def body(arrays):
        output, received = array_ops.alltoall(
            arrays[0], None if splits is None else arrays[1], name, process_set)
        return [output, received.astype(np.int32)]
    inputs = [tensor] if splits is None else [tensor, splits]
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    return graph_op.run(body, inputs, [tensor.dtype, tf.int32],
                        [shape, [process_set.size()]], "alltoall")


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i (equal parts without splits).

    Returns the rows received from every rank in rank order; with ``splits``,
    as Horovod, (those rows, the received splits as int32).
    """
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype == tf.bool:          # Horovod sends booleans too: as bytes
        result = alltoall(tf.cast(tensor, tf.uint8), splits, name, ignore_name_scope,
                          process_set)
        if splits is None:
            return tf.cast(result, tf.bool)
        return tf.cast(result[0], tf.bool), result[1]
    if splits is not None:
        splits = tf.cast(tf.convert_to_tensor(splits), tf.int64)

    @tf.custom_gradient
    def exchange(value):
        output, received = _exchange(value, splits, name, process_set)

        def gradient(upstream, _):
            # Sending every rank's gradient rows back where they came from.
            return _exchange(upstream, tf.cast(received, tf.int64), None, process_set)[0]
        return (output, received), gradient
    output, received = exchange(tensor)
    return output if splits is None else (output, received)
