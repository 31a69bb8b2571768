"""reducescatter and grouped_reducescatter, with their gradients."""

import tensorflow as tf

from mpitrain.api import array_ops
from mpitrain.api.handles import synchronize
from mpitrain.api.process_sets import global_process_set
from mpitrain.errors import not_a_cast_compressor
from mpitrain.ops import Average, resolve_op
from mpitrain.tensorflow import graph_op
from mpitrain.tensorflow.compression import Compression, GradientCompressor
from mpitrain.tensorflow.primitives import gather


def _scatter(tensors, op, prescale_factor, postscale_factor, name, process_set):
    name = graph_op.collective_name(name, "reducescatter")

    def body(arrays):
        return synchronize(array_ops.grouped_reducescatter_async(
            arrays, op, name, process_set, prescale_factor, postscale_factor))
    return graph_op.run(body, tensors, [t.dtype for t in tensors],
                        [tf.TensorShape([None]).concatenate(t.shape[1:])
                         for t in tensors], "reducescatter")


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none,
                          op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Reduce each tensor across the set and give each rank a block of its rows.

    Ranks get equal blocks of the first dimension; lower ranks get one extra
    row when it does not divide evenly.
    """
    op = resolve_op(op, None)
    if isinstance(compression, GradientCompressor):
        raise not_a_cast_compressor("reducescatter", compression)
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    if not compressed:
        return []
    scale = prescale_factor * postscale_factor

    @tf.custom_gradient
    def scatter(*inputs):
        def gradient(*upstream):
            # Each input row reached the rank holding that row's block, scaled.
            gathered = gather(list(upstream), None, process_set)
            if op == Average:
                gathered = [g / process_set.size() for g in gathered]
            return [g * scale for g in gathered] if scale != 1.0 else gathered
        return _scatter(list(inputs), op, prescale_factor, postscale_factor, name,
                        process_set), gradient
    scattered = scatter(*[c for c, _ in compressed])
    return [compression.decompress(s, context)
            for s, (_, context) in zip(scattered, compressed)]


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average,
                  name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across the set; this rank keeps its block of rows."""
    return grouped_reducescatter([tensor], device_dense, compression, op, process_set,
                                 prescale_factor, postscale_factor, name)[0]
