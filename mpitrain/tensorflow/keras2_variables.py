"""Keras 2's ``optimizer.variables()`` on Keras 3's optimizers.

Keras 3 made an optimizer's ``variables`` a property holding a list, and
Horovod's TensorFlow 2 scripts call it, ``hvd.broadcast_variables(
opt.variables(), root_rank=0)`` (its tensorflow2_synthetic_benchmark.py, on a
plain Keras optimizer). Importing mpitrain.tensorflow makes the list that
property returns callable too, so those scripts run unchanged; Keras code
that reads the property gets the same list as before.
"""

import keras


class CallableList(list):
    """A list that calling returns a copy of."""

    def __call__(self):
        return list(self)


def make_optimizer_variables_callable():
    """Let Keras 3's ``optimizer.variables`` also be called, as in Keras 2: on
    its base optimizer and on each optimizer that defines the property anew
    (LossScaleOptimizer adds its own variables to the inner optimizer's)."""
    base = next((klass for klass in keras.optimizers.Optimizer.__mro__
                 if isinstance(vars(klass).get("variables"), property)), None)
    if base is None:            # Keras 2 (tf_keras): variables() is a method already
        return
    for owner in _with_subclasses(base):
        read = vars(owner).get("variables")
        if isinstance(read, property) and \
                not getattr(read.fget, "_mpitrain_keras2_calls", False):
            owner.variables = _callable_variables(read)


def _with_subclasses(klass):
    yield klass
    for subclass in klass.__subclasses__():
        yield from _with_subclasses(subclass)


def _callable_variables(read):
    def variables(self):
        return CallableList(read.fget(self))
    variables._mpitrain_keras2_calls = True
    return property(variables, doc=read.__doc__)
