"""The collectives as single ops on lists of tensors, without gradients.

The public functions add gradients, compression and IndexedSlices on top;
DistributedGradientTape and the Keras optimizer call these directly.
"""

import tensorflow as tf

import mpitrain as mt
from mpitrain.tensorflow import graph_op


def allreduce_arrays(arrays, name, op, prescale_factor, postscale_factor, process_set):
    """Reduce numpy arrays together; the core's results are aligned for TensorFlow."""
    if len(arrays) == 1:     # the name stays the caller's, as errors show it
        return [mt.allreduce(arrays[0], name=name, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, process_set=process_set)]
    return mt.grouped_allreduce(arrays, name=name, op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, process_set=process_set)


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
            return [mt.allgather(arrays[0], name, process_set)]
        return mt.synchronize(mt.grouped_allgather_async(arrays, name, process_set))
    return graph_op.run(body, tensors, [t.dtype for t in tensors],
                        [_gathered_shape(t.shape) for t in tensors], "allgather")
