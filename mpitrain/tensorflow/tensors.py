"""Moving values between TensorFlow tensors and numpy arrays, without copies where possible."""

import ml_dtypes
import numpy as np
import tensorflow as tf

# TensorFlow's allocator aligns CPU buffers to 64 bytes and some kernels rely on it,
# so only buffers aligned as well are handed to TensorFlow without a copy.
ALIGNMENT = 64
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_numpy(tensor):
    """A read-only numpy view of an eager CPU tensor (a copy for other devices)."""
    return np.asarray(tensor)


def aligned_empty(shape, dtype):
    """An uninitialized array whose data TensorFlow can adopt without a copy."""
    dtype = np.dtype(dtype)
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype)[:int(np.prod(shape, dtype=np.int64))] \
        .reshape(shape)


def to_tensor(array):
    """An eager tensor holding ``array``, sharing its memory when it is aligned.

    The tensor keeps the array alive; the caller must not write to the array
    afterwards. Arrays from mpitrain's collectives are fresh, so this holds.
    """
    if array.dtype == _BFLOAT16:        # DLPack has no bfloat16: move the bits
        return tf.bitcast(to_tensor(array.view(np.uint16)), tf.bfloat16)
    if (array.size and array.flags.c_contiguous and array.flags.writeable
            and array.ctypes.data % ALIGNMENT == 0):
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.constant(array)
