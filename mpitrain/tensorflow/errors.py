"""mpitrain's failures as the tf.errors classes TensorFlow users catch.

Each class below is both the tf.errors class and the mpitrain class it maps
(so ``except hvd.HorovodInternalError`` keeps working). Inside tf.function,
TensorFlow itself turns an exception raised by a Python op into an error:
ValueError and TypeError become InvalidArgumentError, NotImplementedError
becomes UnimplementedError and anything else UnknownError, whose message
still names the tensor and says what went wrong.
"""

import tensorflow as tf

from mpitrain import errors as core


def _both(name, tf_class, core_class):
    def __init__(self, message):
        tf_class.__init__(self, None, None, message)
    return type(name, (tf_class, core_class), {"__init__": __init__,
                                               "__module__": __name__})


MismatchError = _both("MismatchError", tf.errors.FailedPreconditionError,
                      core.MismatchError)
CollectiveValueError = _both("CollectiveValueError", tf.errors.InvalidArgumentError,
                             core.CollectiveValueError)
CollectiveTypeError = _both("CollectiveTypeError", tf.errors.InvalidArgumentError,
                            core.CollectiveTypeError)
CollectiveNotImplementedError = _both(
    "CollectiveNotImplementedError", tf.errors.UnimplementedError,
    core.CollectiveNotImplementedError)
ShutdownError = _both("ShutdownError", tf.errors.AbortedError, core.ShutdownError)

_MAPPED = [(core.MismatchError, MismatchError),
           (core.CollectiveValueError, CollectiveValueError),
           (core.CollectiveTypeError, CollectiveTypeError),
           (core.CollectiveNotImplementedError, CollectiveNotImplementedError),
           (core.ShutdownError, ShutdownError)]


def as_tf_error(error):
    """The tf.errors form of a core error; other exceptions come back unchanged."""
    for core_class, tf_class in _MAPPED:
        if isinstance(error, core_class):
            return tf_class(str(error))
    return error
