"""Horovod's rank and size as tensors: rank_op, size_op and the like.

Horovod reads them when the graph runs, for elastic jobs whose ranks change.
mpitrain's MPI world is fixed (docs/fault-tolerance.md), so the values of now
are those of any later run: the ops are int32 constants, as Horovod's dtype.
"""

import tensorflow as tf

from mpitrain.api import basics


def _constant(value, name):
    return tf.constant(value, dtype=tf.int32, name=name)


def _process_set(process_set_id):
    registered = basics.registered_sets()
    if process_set_id not in registered:
        raise ValueError(f"no process set with id {process_set_id} is registered "
                         f"(registered: {sorted(registered)})")
    return registered[process_set_id]


def rank_op(name=None):
    """This process's rank in the job."""
    return _constant(basics.rank(), name)


def local_rank_op(name=None):
    """This process's rank on its host."""
    return _constant(basics.local_rank(), name)


def size_op(process_set_id=0, name=None):
    """The number of ranks of a process set (by default the job's)."""
    return _constant(_process_set(process_set_id).size(), name)


def local_size_op(name=None):
    """The number of ranks on this host."""
    return _constant(basics.local_size(), name)


def process_set_included_op(process_set_id=0, name=None):
    """1 where this process belongs to the process set, else 0."""
    return _constant(int(_process_set(process_set_id).included()), name)
