"""Optimizers that wrap a user's optimizer by becoming an instance of its class.

DistributedOptimizer, its Adasum form and LocalSGDOptimizer return an object
whose class is a subclass of the user's optimizer class with their methods
first, so that isinstance checks and LR schedulers still hold.
"""

import functools


@functools.cache
def mixed_in(mixin, base):
    """The subclass of ``base`` with ``mixin``'s methods first (one per pair)."""
    return type(base.__name__, (mixin, base), {"__module__": base.__module__})


def rewrapped(optimizer, mixin):
    """A new instance of mixed_in(mixin, type(optimizer)) that shares
    ``optimizer``'s state and parameter groups."""
    cls = mixed_in(mixin, type(optimizer))
    wrapped = cls.__new__(cls)
    attributes = dict(vars(optimizer))
    # An LR scheduler made before wrapping stores a step bound to the original
    # optimizer as an attribute; keeping it would bypass the wrapper's step.
    attributes.pop("step", None)
    wrapped.__dict__.update(attributes)
    return wrapped
