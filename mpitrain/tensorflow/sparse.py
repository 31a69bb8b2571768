"""tf.IndexedSlices reduced as Horovod does: gather every rank's values and indices."""

import tensorflow as tf

from mpitrain.ops import Average, Sum
from mpitrain.tensorflow.allgather import grouped_allgather


def check_sparse_arguments(op, prescale_factor, postscale_factor):
    """NotImplementedError, as in Horovod, for what gathered slices cannot do."""
    if op not in (Average, Sum):
        raise NotImplementedError(
            f"IndexedSlices (e.g. an Embedding's gradient) travel through "
            f"allgather, which supports only op=Average and op=Sum, not "
            f"{op.name.capitalize()}; densify first (tf.convert_to_tensor, or "
            "sparse_as_dense=True)")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError(
            "IndexedSlices travel through allgather, which cannot apply "
            "prescale_factor or postscale_factor; densify first "
            "(tf.convert_to_tensor, or sparse_as_dense=True)")


def allreduce_indexed_slices(slices, op, prescale_factor, postscale_factor, name,
                             process_set):
    """Average or sum IndexedSlices; repeated indices add up when applied."""
    check_sparse_arguments(op, prescale_factor, postscale_factor)
    values, indices = grouped_allgather([slices.values, slices.indices], name,
                                        process_set=process_set)
    if op == Average:
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)
