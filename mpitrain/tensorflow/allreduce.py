"""allreduce and grouped_allreduce on tensors, with their gradients."""

import tensorflow as tf

from mpitrain.api.process_sets import global_process_set
from mpitrain.errors import not_a_cast_compressor
from mpitrain.ops import OpType, resolve_op
from mpitrain.tensorflow import primitives
from mpitrain.tensorflow.compression import Compression, GradientCompressor
from mpitrain.tensorflow.primitives import reduce_dense
from mpitrain.tensorflow.sparse import allreduce_indexed_slices, check_sparse_arguments


def _reduce_with_gradient(tensors, op, prescale_factor, postscale_factor, name,
                          process_set):
    @tf.custom_gradient
    def reduce(*inputs):
        def gradient(*upstream):
            # The gradient of a reduction is the same reduction of the gradients;
            # every rank reduces every tensor, so none may be left out.
            upstream = [tf.zeros_like(x) if g is None else g
                        for g, x in zip(upstream, inputs)]
            return _reduce_with_gradient(upstream, op, prescale_factor,
                                         postscale_factor, None, process_set)
        return reduce_dense(list(inputs), op, prescale_factor, postscale_factor,
                            name, process_set), gradient
    return reduce(*tensors)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduce a list of tensors across the set, all through one op.

    Dense tensors travel together; tf.IndexedSlices travel through allgather.
    """
    if isinstance(compression, GradientCompressor):
        raise not_a_cast_compressor("allreduce", compression)
    op = resolve_op(op, average)
    results = list(tensors)
    dense = [i for i, t in enumerate(results) if not isinstance(t, tf.IndexedSlices)]
    sparse = [i for i in range(len(results)) if i not in set(dense)]
    if sparse:      # before any exchange, as Horovod: no rank sends half a group
        check_sparse_arguments(op, prescale_factor, postscale_factor)
    if dense:
        tensors = primitives.dense([results[i] for i in dense], OpType.ALLREDUCE, name,
                                   process_set)
        compressed = [compression.compress(tensor) for tensor in tensors]
        reduced = _reduce_with_gradient([c for c, _ in compressed], op,
                                        prescale_factor, postscale_factor, name,
                                        process_set)
        for i, value, (_, context) in zip(dense, reduced, compressed):
            results[i] = compression.decompress(value, context)
    for number, i in enumerate(sparse):
        results[i] = allreduce_indexed_slices(
            results[i], op, prescale_factor, postscale_factor,
            None if name is None else f"{name}.sparse{number}", process_set)
    return results


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` across the set (Average by default).

    A tf.IndexedSlices is gathered instead (values and indices from every
    rank), which supports only Average and Sum without scale factors.
    """
    return grouped_allreduce([tensor], average, device_dense, device_sparse,
                             compression, op, prescale_factor, postscale_factor,
                             process_set, ignore_name_scope, name)[0]
