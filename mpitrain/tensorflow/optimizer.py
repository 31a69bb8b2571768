"""horovod.tensorflow's DistributedOptimizer: TF1-style optimizers, or Keras ones.

A ``tf.compat.v1.train.Optimizer`` is wrapped here: its compute_gradients
(which minimize calls) averages the gradients across ranks. A Keras
optimizer goes to mpitrain.tensorflow.keras.DistributedOptimizer, as
Horovod hands it to its Keras module.
"""

import tensorflow as tf

from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Average
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.gradient_reduction import GradientReducer


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Averages what the wrapped optimizer's compute_gradients returns."""

    def __init__(self, optimizer, name, use_locking, reducer):
        super().__init__(use_locking, name or f"Distributed{type(optimizer).__name__}")
        self._optimizer = optimizer
        self._reducer = reducer

    def compute_gradients(self, *args, **kwargs):
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        gradients, variables = zip(*pairs)
        return list(zip(self._reducer.reduce(gradients, variables), variables))

    def apply_gradients(self, *args, **kwargs):
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)

    def register_local_var(self, var):
        """Keep ``var``'s gradient local to this rank (it is not reduced)."""
        self._reducer.register_local(var)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap ``optimizer`` so that the gradients it applies are averaged across ranks."""
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        from mpitrain.tensorflow.keras.optimizer import DistributedOptimizer as for_keras
        return for_keras(optimizer, name, device_dense, device_sparse, compression,
                         sparse_as_dense, gradient_predivide_factor, op,
                         backward_passes_per_step, average_aggregated_gradients,
                         num_groups, groups, process_set, scale_local_gradients)
    if backward_passes_per_step != 1:
        raise NotImplementedError(
            "backward_passes_per_step > 1 is implemented for Keras optimizers only; "
            "wrap a Keras optimizer, or accumulate the gradients yourself")
    return _DistributedOptimizer(optimizer, name, use_locking, GradientReducer(
        compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
        process_set, scale_local_gradients))
