"""Which gradients a GradientReducer compresses, and with what."""

from mpitrain.api.compression import chosen_compressor
from mpitrain.tensorflow.compression.casts import NoneCompressor
from mpitrain.tensorflow.compression.gathered import GradientCompressor


def split(compression):
    """(the Horovod compressor of the fused allreduce, choose(name, shape)).

    ``choose`` gives a GradientCompressor or None (uncompressed) for a
    variable's name (its Keras path where it has one) and gradient shape.
    ``compression`` is a Horovod compressor, a GradientCompressor (for the
    shapes it ``applies_to``), a dict of names, or a function of (name, shape).
    """
    if isinstance(compression, GradientCompressor):
        return NoneCompressor, lambda name, shape: (
            compression if compression.applies_to(shape) else None)
    if isinstance(compression, dict):
        return NoneCompressor, _checked(lambda name, shape: compression.get(name))
    if callable(compression) and not isinstance(compression, type):
        return NoneCompressor, _checked(compression)
    return compression, None


def _checked(choose):
    def checked(name, shape):
        return chosen_compressor(choose(name, shape), name, "variable", NoneCompressor,
                                 GradientCompressor)
    return checked
