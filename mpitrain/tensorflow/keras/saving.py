"""load_model: reload a saved model with its optimizer wrapped for data parallelism."""

import tensorflow as tf

from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.keras.optimizer import DistributedOptimizer
from mpitrain.tensorflow.keras.variables import optimizer_variables


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Load a model saved by Keras and wrap its optimizer in DistributedOptimizer.

    The optimizer's saved state (slots, iteration count) is kept.
    custom_optimizers: optimizer classes the file refers to that Keras does
    not know. legacy_opts is accepted for Horovod compatibility and ignored.
    """
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    model = tf.keras.models.load_model(filepath, custom_objects=objects)
    loaded = getattr(model, "optimizer", None)
    if loaded is None:
        return model
    wrapped = DistributedOptimizer(loaded, compression=compression)
    state = optimizer_variables(loaded)
    if state and getattr(loaded, "built", True):
        wrapped.build(model.trainable_variables)
        for target, value in zip(optimizer_variables(wrapped), state):
            target.assign(value)
    model.optimizer = wrapped
    return model
