"""Broadcasting a Keras model's and optimizer's variables."""

import tensorflow as tf

from mpitrain.tensorflow.broadcast import broadcast_variables
from mpitrain.tensorflow.keras.optimizer import gradient_reducer


def optimizer_variables(optimizer):
    """An optimizer's variables: a property in Keras 3, a method in older tf_keras."""
    if optimizer is None:
        return []
    found = optimizer.variables
    return list(found() if callable(found) else found)


def broadcast_compression_state(optimizer, root_rank):
    """Give every rank root_rank's compressor state (PowerSGD's Q) of a
    DistributedOptimizer; each rank keeps its own residuals."""
    reducer = gradient_reducer(optimizer)
    if reducer is not None:
        reducer.broadcast_compression_state(root_rank)


def broadcast_global_variables(root_rank, model=None):
    """Give every rank root_rank's values of the job's variables.

    TensorFlow 2 has no collection of global variables: pass the Keras model,
    whose variables, optimizer variables and compressor state are broadcast. Without a model
    this works only in a TF1-style graph (tf.compat.v1).
    """
    if model is not None:
        optimizer = getattr(model, "optimizer", None)
        broadcast_variables(list(model.variables) + optimizer_variables(optimizer),
                            root_rank)
        broadcast_compression_state(optimizer, root_rank)
        return
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables(root_rank) needs a graph collection of "
            "variables, which TensorFlow 2 does not keep: call "
            "broadcast_global_variables(root_rank, model=model), "
            "hvd.broadcast_variables(variables, root_rank), or use "
            "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit()")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
