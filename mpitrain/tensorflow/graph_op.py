"""One TensorFlow op per collective call, eagerly and inside tf.function.

A collective's body works on numpy arrays and calls the numpy core. Eagerly
it runs at once on zero-copy views of the tensors. Inside tf.function it
becomes a single stateful ``tf.numpy_function``: TensorFlow runs stateful ops
in program order and never prunes them, so every rank issues its collectives
in the same order, and a grouped call submits all its tensors at once.
"""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from mpitrain.tensorflow import session_graph
from mpitrain.tensorflow.errors import as_tf_error
from mpitrain.tensorflow.tensors import to_array, to_tensor


class XlaNotSupportedError(ValueError):
    """mpitrain's collectives run in Python, which XLA cannot compile."""


def collective_name(name, kind):
    """The name that matches this call across ranks.

    Inside a graph an unnamed call gets a name unique within that graph, the
    same on every rank and in every step, so the core's response cache hits;
    eagerly, None lets the core count unnamed calls.
    """
    if name is not None or tf.executing_eagerly():
        return name
    return tf.compat.v1.get_default_graph().unique_name(f"mpitrain.{kind}")


def run(body, inputs, output_dtypes, output_shapes, what):
    """Run ``body(list of arrays) -> list of arrays`` as one op on ``inputs``."""
    if not inputs:
        return []
    if tf.executing_eagerly():
        try:
            results = body([to_array(tensor) for tensor in inputs])
        except Exception as error:
            mapped = as_tf_error(error)
            if mapped is error:
                raise
            raise mapped from error
        return [to_tensor(result) for result in results]
    graph = tf.compat.v1.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise XlaNotSupportedError(
            f"mpitrain cannot run {what} inside XLA-compiled code: its MPI "
            "collectives run in Python (tf.numpy_function), which XLA cannot "
            "compile. Use tf.function(jit_compile=False), or for Keras "
            "model.compile(..., jit_compile=False) (Keras picks jit_compile=True "
            "by itself when a GPU is present).")
    if tf.compat.v1.executing_eagerly_outside_functions():
        outputs = tf.numpy_function(lambda *arrays: body(list(arrays)), list(inputs),
                                    list(output_dtypes), stateful=True,
                                    name=what.replace(" ", "_"))
    else:       # a TF1 graph, whose session starts ops in any order
        outputs = session_graph.run(body, inputs, output_dtypes, what.replace(" ", "_"))
    for output, shape in zip(outputs, output_shapes):
        output.set_shape(shape)
    return outputs
