"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged across ranks."""

import tensorflow as tf

from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Average
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.gradient_reduction import GradientReducer, local_weights


class _DistributedGradientTape(tf.GradientTape):
    """Methods given to the tape class built by DistributedGradientTape."""

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        gradients = super(self.__class__, self).gradient(
            target, sources, output_gradients, unconnected_gradients)
        flat = self._mpitrain_reducer.reduce(tf.nest.flatten(gradients),
                                             tf.nest.flatten(sources))
        return tf.nest.pack_sequence_as(gradients, flat)

    def register_local_source(self, source):
        """Keep ``source``'s gradient local to this rank (it is not reduced)."""
        self._mpitrain_reducer.register_local(source)


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False,
                            op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set,
                            scale_local_gradients=True):
    """Wrap ``gradtape`` so that gradient() returns gradients averaged across ranks.

    The result shares the recorded operations of ``gradtape`` and has its
    class name; None gradients pass through, IndexedSlices travel through
    allgather unless sparse_as_dense. Sources registered with
    register_local_source() keep their local gradient (divided by the set's
    size when scale_local_gradients).
    """
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,),
               dict(_DistributedGradientTape.__dict__))
    tape = cls(persistent=gradtape._persistent,
               watch_accessed_variables=gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape
    tape._mpitrain_reducer = GradientReducer(
        compression, sparse_as_dense, op, gradient_predivide_factor, num_groups,
        groups, process_set, scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None,
                                   process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """DistributedGradientTape whose ``local_layers`` keep their gradients local.

    local_layers: a Keras layer or a list of them; the gradients of their
    trainable weights are not reduced (divided by the set's size when
    scale_local_gradients).
    """
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for weight in local_weights(local_layers):
        tape.register_local_source(weight)
    return tape
