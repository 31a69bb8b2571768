"""DistributedOptimizer: a Keras optimizer that averages gradients across ranks.

Keras 3 funnels every update through ``apply(grads, variables)``
(apply_gradients, model.fit and LossScaleOptimizer all reach it), so the
wrapper reduces there, before unscaling, clipping and weight decay. tf_keras
(Keras 2, TF_USE_LEGACY_KERAS=1) funnels them through ``apply_gradients``.
Wrapping the outermost optimizer matters for LossScaleOptimizer: its finite
check then sees reduced gradients, so every rank makes the same decision.
"""

import functools
import sys

import keras

from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Adasum, Average, Sum
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.gradient_reduction import GradientReducer, local_weights
from mpitrain.tensorflow.keras.local_aggregation import LocalAggregation


class _Distribution:
    """What a distributed optimizer does with gradients before applying them."""

    def __init__(self, reducer, backward_passes_per_step, average_aggregated_gradients):
        self.reducer = reducer
        self.aggregation = (LocalAggregation(backward_passes_per_step,
                                             average_aggregated_gradients)
                            if backward_passes_per_step > 1 else None)

    def apply(self, optimizer, gradients, variables, apply_reduced):
        if self.aggregation is None:
            return apply_reduced(self.reducer.reduce(gradients, variables))
        return self.aggregation.apply(optimizer, gradients, variables,
                                      lambda summed: apply_reduced(
                                          self.reducer.reduce(summed, variables)))


def _refuse_inside_loss_scale_optimizer(optimizer, caller):
    """A LossScaleOptimizer around a DistributedOptimizer checks each rank's own
    gradients for an overflow, and a rank that finds one skips the allreduce
    its peers wait in. The outer optimizer's build() builds this one first."""
    outer = caller.f_locals.get("self")
    if isinstance(outer, keras.optimizers.LossScaleOptimizer) \
            and outer.inner_optimizer is optimizer:
        raise ValueError(
            "a LossScaleOptimizer wraps a DistributedOptimizer: each rank would "
            "check its own gradients for overflow, and a rank that skips the step "
            "would leave the others waiting in the allreduce. Wrap the other way "
            "round: hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer"
            "(optimizer))")


def _is_keras3(cls):
    return issubclass(cls, keras.optimizers.Optimizer)


@functools.lru_cache(maxsize=None)
def distributed_class(base):
    """A subclass of ``base`` with its name, module and config, reducing gradients."""
    if _is_keras3(base):
        def apply(self, grads, trainable_variables=None):
            if trainable_variables is None:     # Keras requires a built optimizer then
                variables = self._trainable_variables if self.built else None
            else:
                variables = list(trainable_variables)
                if not self.built:
                    # As Keras would on first use, but before any tf.cond of
                    # local aggregation, where no variable may be created.
                    with keras.name_scope(self.name, caller=self):
                        self.build(variables)
            return self._mpitrain.apply(
                self, list(grads), variables,
                lambda reduced: base.apply(self, reduced, trainable_variables))

        def build(self, variables):
            _refuse_inside_loss_scale_optimizer(self, sys._getframe(1))
            return base.build(self, variables)
        methods = {"apply": apply, "build": build}
    elif hasattr(base, "apply_gradients"):
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            grads, variables = zip(*list(grads_and_vars))
            return self._mpitrain.apply(
                self, list(grads), list(variables),
                lambda reduced: base.apply_gradients(
                    self, list(zip(reduced, variables)), *args, **kwargs))
        methods = {"apply_gradients": apply_gradients}
    else:
        raise TypeError(f"{base.__module__}.{base.__qualname__} is not a Keras "
                        "optimizer: DistributedOptimizer wraps Keras 3 and tf_keras "
                        "optimizers (and, from mpitrain.tensorflow, "
                        "tf.compat.v1.train optimizers)")
    methods.update(__module__=base.__module__, __qualname__=base.__qualname__,
                   _mpitrain_distributed=True, register_local_var=_register_local_var)
    return type(base.__name__, (base,), methods)


def gradient_reducer(optimizer):
    """A DistributedOptimizer's GradientReducer (its compressors' state), else None."""
    distribution = getattr(optimizer, "_mpitrain", None)
    return None if distribution is None else distribution.reducer


def _register_local_var(self, var):
    """Keep ``var``'s gradient local to this rank (it is not reduced)."""
    self._mpitrain.reducer.register_local(var)


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set,
                         scale_local_gradients=True):
    """Return a copy of ``optimizer`` (same class name and config) that averages
    gradients across ranks before applying them.

    Wrap the outermost optimizer, e.g. the LossScaleOptimizer, not its inner
    one. backward_passes_per_step > 1 sums that many steps' gradients locally
    (divided by their number with average_aggregated_gradients) and
    communicates and applies once. ``name`` renames the optimizer (None
    keeps its name). Variables given to ``register_local_var`` keep their
    local gradients, divided by the set's size when scale_local_gradients.
    device_dense and device_sparse are accepted for Horovod compatibility
    and have no effect.
    """
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer supports op=Average, op=Sum and "
                         f"op=Adasum, got {op!r}")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1, got "
                         f"{backward_passes_per_step}")
    if getattr(optimizer, "_mpitrain_distributed", False):
        raise ValueError(f"{type(optimizer).__name__} is already a "
                         "DistributedOptimizer; wrap it once")
    cls = distributed_class(type(optimizer))      # a TypeError for a non-optimizer
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    distributed = cls.from_config(config)
    distributed._mpitrain = _Distribution(
        GradientReducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                        num_groups, groups, process_set, scale_local_gradients),
        backward_passes_per_step, average_aggregated_gradients)
    return distributed


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1,
                                average_aggregated_gradients=False, groups=None,
                                process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """DistributedOptimizer whose ``local_layers`` keep their gradients local."""
    distributed = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step,
        average_aggregated_gradients, groups=groups, process_set=process_set,
        scale_local_gradients=scale_local_gradients)
    for weight in local_weights(local_layers):
        distributed.register_local_var(weight)
    return distributed
