"""The collectives as single ops on lists of tensors, without gradients.

The public functions add gradients, compression and IndexedSlices on top;
DistributedGradientTape and the Keras optimizer call these directly.
"""

import tensorflow as tf

from mpitrain.api import array_ops
from mpitrain.api.handles import synchronize
from mpitrain.tensorflow import graph_op
from mpitrain.tensorflow.errors import as_tf_error


def dense(tensors, kind, name, process_set, count="members"):
    """The tensors as dense tensors. Eagerly, one this rank cannot convert (a
    RaggedTensor, say) fails the call on every rank at once, naming this rank,
    instead of leaving the others waiting for it. ``count``: the members of
    the grouped call the core makes (by default one call for one tensor)."""
    try:
        return [tf.convert_to_tensor(t) for t in tensors]
    except (TypeError, ValueError) as error:
        if not tf.executing_eagerly():
            raise
        problem = f"{kind.label} input cannot be a dense tensor: {error}"
        try:
            array_ops.fail(kind, name, process_set,
                           "type" if isinstance(error, TypeError) else "value", problem,
                           count=(None if len(tensors) == 1 else len(tensors))
                           if count == "members" else count)
        except Exception as failed:
            raise as_tf_error(failed) from error


def allreduce_arrays(arrays, name, op, prescale_factor, postscale_factor, process_set):
    """Reduce numpy arrays together; the core's results are aligned for TensorFlow."""
    if len(arrays) == 1:     # the name stays the caller's, as errors show it
        return [array_ops.allreduce(arrays[0], name=name, op=op,
                                    prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, process_set=process_set)]
    return array_ops.grouped_allreduce(arrays, name=name, op=op,
                                       prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor,
                                       process_set=process_set)


def reduce_dense(tensors, op, prescale_factor, postscale_factor, name, process_set):
    """Reduce dense tensors, all submitted together by one op."""
    name = graph_op.collective_name(name, "allreduce")
    return graph_op.run(
        lambda arrays: allreduce_arrays(arrays, name, op, prescale_factor,
                                        postscale_factor, process_set),
        tensors, [t.dtype for t in tensors], [t.shape for t in tensors], "allreduce")


def _gathered_shape(shape):
    return tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else shape


def gather(tensors, name, process_set):
    """Gather tensors along the first dimension, all submitted together by one op."""
    name = graph_op.collective_name(name, "allgather")

    def body(arrays):
        if len(arrays) == 1:
            return [array_ops.allgather(arrays[0], name, process_set)]
        return synchronize(array_ops.grouped_allgather_async(arrays, name, process_set))
    return graph_op.run(body, tensors, [t.dtype for t in tensors],
                        [_gathered_shape(t.shape) for t in tensors], "allgather")
