"""broadcast, broadcast_ (in place on variables), broadcast_variables and
broadcast_global_variables (TF1 graphs)."""

import numpy as np
import tensorflow as tf

from mpitrain.api import array_ops
from mpitrain.api.handles import synchronize_all
from mpitrain.api.process_sets import global_process_set, is_root
from mpitrain.backends import dtypes
from mpitrain.errors import CollectiveTypeError
from mpitrain.ops import Average, OpType
from mpitrain.tensorflow import graph_op
from mpitrain.tensorflow.primitives import dense, reduce_dense


def _movable(array):
    """The array itself, or its raw bytes when the core has no such dtype (bool, uint32...).

    Strings (object arrays) have no raw bytes to move: they go as they are,
    and the core refuses them on every rank.
    """
    if dtypes.lookup(array.dtype) is not None or array.dtype == object:
        return array
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _start(array, root_rank, name, process_set):
    try:
        return array_ops.broadcast_async(_movable(array), root_rank, name, process_set)
    except CollectiveTypeError as error:
        if array.dtype != object:
            raise
        raise CollectiveTypeError(
            f"{error} (here a tf.string tensor: broadcast moves numbers and bools; "
            "send strings with broadcast_object)") from None


def send_from_root(tensors, root_rank, name, process_set):
    """Broadcast tensors from root_rank through one op, without gradients."""
    name = graph_op.collective_name(name, "broadcast")

    def body(arrays):
        names = ([None] * len(arrays) if name is None else
                 [f"{name}_{i}of{len(arrays)}" for i in range(len(arrays))])
        handles, errors = [], []
        for array, array_name in zip(arrays, names):
            try:
                handles.append(_start(array, root_rank, array_name, process_set))
            except Exception as error:      # submit the rest, so no peer waits for them
                errors.append(error)
        results, failed = synchronize_all(handles)     # none left in flight on failure
        errors += failed
        if errors:
            raise errors[0]
        return [r.view(a.dtype).reshape(a.shape) for r, a in zip(results, arrays)]
    return graph_op.run(body, tensors, [t.dtype for t in tensors],
                        [t.shape for t in tensors], "broadcast")


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Return root_rank's ``tensor`` on every rank of the set."""
    @tf.custom_gradient
    def send(value):
        def gradient(upstream):
            # Every rank's output came from the root: the root's input gets
            # the average of the gradients (Horovod's convention, the gradient
            # of the ranks' average loss), the other inputs none.
            averaged = reduce_dense([upstream], Average, 1.0, 1.0, None, process_set)[0]
            if is_root(root_rank, process_set):
                return averaged
            # A session runs only what its fetches need, and zeros of a known
            # shape need nothing: the dependency keeps this rank in the allreduce.
            with tf.control_dependencies([averaged]):
                return tf.zeros_like(upstream)
        return send_from_root([value], root_rank, name, process_set)[0], gradient
    # send_from_root names a named tensor as the one member of a group
    count = None if name is None else 1
    return send(dense([tensor], OpType.BROADCAST, name, process_set, count)[0])


def broadcast_variables(variables, root_rank, process_set=global_process_set,
                        inplace=False):
    """Assign root_rank's values to ``variables`` on every rank, through one op.

    Works on tf.Variable and Keras variables; returns the assign ops' results
    (a list, None eagerly). ``inplace`` is accepted for Horovod compatibility:
    variables are always assigned in place.
    """
    variables = list(variables)
    values = send_from_root([tf.convert_to_tensor(v) for v in variables],
                            root_rank, None, process_set)
    assigned = [v.assign(value) for v, value in zip(variables, values)]
    return None if tf.executing_eagerly() else assigned


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast of variables from root_rank; returns their values read
    after the assignment, as Horovod does (in a graph, running those runs it)."""
    variables = list(variables)
    values = send_from_root([tf.convert_to_tensor(v) for v in variables],
                            root_rank, name, process_set)
    with tf.control_dependencies([v.assign(value) for v, value in zip(variables, values)]):
        return [tf.identity(v) for v in variables]


def broadcast_global_variables(root_rank):
    """Assign root_rank's values to a TF1 graph's global variables (assign ops)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() needs a TF1 graph's global variables, which "
            "eager TensorFlow does not keep: use broadcast_variables(model.variables, "
            "root_rank) or mpitrain.tensorflow.keras.broadcast_global_variables("
            "root_rank, model=model)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)
