"""DistributedGradientTape: a tf.GradientTape whose gradients are averaged across ranks."""

import tensorflow as tf

from mpitrain.ops import Average
from mpitrain.process_sets import global_process_set
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.gradient_reduction import GradientReducer


class _DistributedGradientTape(tf.GradientTape):
    """Methods given to the tape class built by DistributedGradientTape."""

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        gradients = super(self.__class__, self).gradient(
            target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(gradients, expand_composites=False)
        local = [i for i, s in enumerate(flat_sources) if id(s) in self._mpitrain_local]
        shared = [i for i in range(len(flat)) if i not in set(local)]
        reduced = self._mpitrain_reducer.reduce([flat[i] for i in shared],
                                                [flat_sources[i] for i in shared])
        for i, value in zip(shared, reduced):
            flat[i] = value
        if self._mpitrain_scale_local:
            size = self._mpitrain_reducer.process_set.size()
            for i in local:
                if flat[i] is not None:
                    flat[i] = flat[i] / size
        return tf.nest.pack_sequence_as(gradients, flat)

    def register_local_source(self, source):
        """Keep ``source``'s gradient local to this rank (it is not reduced)."""
        self._mpitrain_local.add(id(source))


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
        groups, process_set)
    tape._mpitrain_local = set()
    tape._mpitrain_scale_local = scale_local_gradients
    return tape
