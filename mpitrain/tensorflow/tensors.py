"""Moving values between TensorFlow tensors and arrays, without copies where possible."""

import ml_dtypes
import numpy as np
import tensorflow as tf

from mpitrain.backends import arrays
from mpitrain.backends.host import ALIGNMENT

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_array(tensor):
    """The core's view of an eager tensor.

    On the CPU, a read-only numpy view. On a GPU, a CuPy view through DLPack
    where mpitrain can reduce device arrays (TensorFlow finishes the tensor
    before handing it over), else a host copy.
    """
    if "GPU" in tensor.device.upper() and arrays.cupy() is not None:
        if tensor.dtype == tf.bfloat16:         # CuPy may not take bfloat16 through DLPack
            bits = tf.experimental.dlpack.to_dlpack(tf.bitcast(tensor, tf.int16))
            return arrays.cupy().from_dlpack(bits).view(_BFLOAT16)
        return arrays.cupy().from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    return np.asarray(tensor)


def to_tensor(array):
    """An eager tensor holding ``array``, sharing its memory when it is aligned.

    The tensor keeps the array alive; the caller must not write to the array
    afterwards. Arrays from mpitrain's collectives are fresh, so this holds.
    """
    if arrays.of(array) not in (arrays.HOST, None):      # a CuPy array on a GPU
        if array.dtype == _BFLOAT16:
            bits = tf.experimental.dlpack.from_dlpack(array.view(np.int16).toDlpack())
            return tf.bitcast(bits, tf.bfloat16)
        return tf.experimental.dlpack.from_dlpack(array.toDlpack())
    if array.dtype == _BFLOAT16:        # DLPack has no bfloat16: move the bits
        return tf.bitcast(to_tensor(array.view(np.uint16)), tf.bfloat16)
    if (array.size and array.flags.c_contiguous and array.flags.writeable
            and array.ctypes.data % ALIGNMENT == 0):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.constant(array)
