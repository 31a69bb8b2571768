"""The collectives of Horovod's Keras module, with its signatures.

horovod.tensorflow.keras takes a ``value`` (a tensor, an array or a number)
and the name second (``hvd.allreduce(loss, "loss")``), where
horovod.tensorflow's functions take the average flag or the root rank
there; each returns a tensor, as the TensorFlow collective it calls.
"""

import tensorflow as tf

from mpitrain.ops import Average
from mpitrain.tensorflow import allgather as _allgather
from mpitrain.tensorflow import allreduce as _allreduce
from mpitrain.tensorflow import broadcast as _broadcast
from mpitrain.tensorflow import reducescatter as _reducescatter
from mpitrain.tensorflow.compression import Compression


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """The reduction of ``value`` over all ranks (by default their average)."""
    return _allreduce(tf.convert_to_tensor(value), average=average, compression=compression,
                      op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, name=name)


def allgather(value, name=None):
    """Every rank's ``value`` concatenated along the first dimension."""
    return _allgather(tf.convert_to_tensor(value), name=name)


def broadcast(value, root_rank, name=None):
    """``value`` of rank ``root_rank``, on every rank."""
    return _broadcast(tf.convert_to_tensor(value), root_rank, name=name)


def reducescatter(value, name=None, op=Average):
    """This rank's slice of the reduction of ``value`` over all ranks."""
    return _reducescatter(tf.convert_to_tensor(value), op=op, name=name)
