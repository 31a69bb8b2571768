"""Averaging a step's gradients across ranks, shared by the tape and the optimizers."""

import numpy as np
import tensorflow as tf

from mpitrain.api.agreement import require_same
from mpitrain.api.compression import saved_states
from mpitrain.api.engine_sizes import streamed
from mpitrain.api.objects import broadcast_object
from mpitrain.api.process_sets import global_process_set, is_root
from mpitrain.ops import Adasum, Average, ReduceOp, Sum
from mpitrain.tensorflow import graph_op
from mpitrain.tensorflow.compression import Compression, choice
from mpitrain.tensorflow.packed import PACKABLE, PackedReducer
from mpitrain.tensorflow.primitives import allreduce_arrays
from mpitrain.tensorflow.sparse import allreduce_indexed_slices

# Ids of the process sets whose ranks agreed that none of them chooses a
# compressor per gradient (GradientReducer._agree).
_AGREED_THAT_NONE_CHOOSES = set()


class GradientReducer:
    """Reduces lists of gradients (None entries pass through) with fixed settings.

    groups: None (all dense gradients in one op), a number of groups of
    consecutive gradients, or lists of variables, one op per list (gradients
    of variables in no list form one more group). Ranks must pass gradients
    in the same order, which the same model code does.
    """

    def __init__(self, compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True):
        op = ReduceOp(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average, got "
                             f"op={op.name.capitalize()}")
        if groups is None and num_groups:
            groups = num_groups
        if isinstance(groups, int) and groups < 0:
            raise ValueError(f"groups must be a number >= 0 or lists of variables, "
                             f"got {groups}")
        # choose(name, shape): the compressor that moves a gradient itself, or None.
        self.compression, self.choose = choice.split(compression)
        if self.choose is not None and op not in (Average, Sum):
            raise ValueError("compressors such as Compression.topk sum what they "
                             f"receive: op must be Average or Sum, got {op.name}")
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        # Dividing before the sum keeps large fp16 sums in range; Average
        # divides the rest after it.
        self.prescale = 1.0 / gradient_predivide_factor
        self.postscale = gradient_predivide_factor
        self.groups = groups
        self.process_set = process_set
        self.packed = PackedReducer()
        self.local = set()        # ids of variables whose gradients stay on this rank
        self.scale_local = scale_local_gradients
        # By the gradient's position, which a rebuilt model keeps, unlike its
        # Keras paths (layer names count up within a process).
        self.compressors = {}     # position -> (key, the GradientCompressor used)
        self.loaded = {}          # position -> (state, own) for gradients not reduced yet

    def compression_state(self):
        """The compressors' residuals and PowerSGD's Q as numpy arrays, with this
        rank: {"rank": r, "parameters": {position: {field: array}}}, or None."""
        return saved_states({str(i): compressor.state(key)
                             for i, (key, compressor) in self.compressors.items()},
                            self.process_set.rank())

    def load_compression_state(self, saved):
        """Take back ``compression_state()``'s result, saved on any rank: Q on
        every rank, residuals only on the rank that saved them (another rank's
        residual is that rank's error; every rank adding it would count it n
        times). State for gradients not reduced yet waits for their first step."""
        own = saved["rank"] == self.process_set.rank()
        for i, state in saved["parameters"].items():
            if int(i) in self.compressors:
                key, compressor = self.compressors[int(i)]
                compressor.load_state(key, state, own)
            else:
                self.loaded[int(i)] = (state, own)

    def broadcast_compression_state(self, root_rank):
        """Give every member of the set root_rank's Q (residuals stay each
        rank's own); where the job's root_rank is outside the set, the set's
        first member's, so that the members still agree."""
        members = self.process_set.ranks
        if self.choose is None or not self.process_set.included():
            return                  # no compressor of that kind, or nothing to share
        if root_rank not in members:
            root_rank = members[0]
        saved = broadcast_object(self.compression_state() if
                                 is_root(root_rank, self.process_set) else None,
                                 root_rank, "mpitrain.compression.state", self.process_set)
        if saved is not None:
            self.load_compression_state(saved)

    def register_local(self, variable):
        """Keep ``variable``'s gradient local (divided by the set's size when
        scale_local_gradients), wherever reduce() is given the variables."""
        self.local.add(id(variable))

    def reduce(self, gradients, variables=None):
        """The reduced gradients, in order; ``variables`` tell groups and local ones.

        A rank outside the process set keeps its own gradients, as in Horovod.
        """
        gradients = list(gradients)
        if not self.process_set.included():
            return gradients
        results = list(gradients)
        local = ([id(v) in self.local for v in variables] if self.local and variables
                 else [False] * len(gradients))
        dense = []
        for i, gradient in enumerate(gradients):
            if gradient is None:
                continue
            if local[i]:
                if self.scale_local:
                    results[i] = _divided(gradient, self.process_set.size())
                continue
            if isinstance(gradient, tf.IndexedSlices) and not self.sparse_as_dense:
                # Gathered slices are never summed, so the predivide factor,
                # which only guards sums, does not apply to them.
                results[i] = allreduce_indexed_slices(gradient, self.op, 1.0, 1.0, None,
                                                      self.process_set)
            else:
                dense.append(i)
        choices = {i: self._choice(i, gradients, variables) for i in dense}
        with tf.control_dependencies(self._agree(choices)):
            for i, (name, compressor) in choices.items():
                if compressor is not None:
                    results[i] = self._compressed(i, name, gradients[i], compressor)
            for members in self._split([i for i in dense if choices[i][1] is None],
                                       variables):
                compressed = [self.compression.compress(tf.convert_to_tensor(gradients[i]))
                              for i in members]
                reduced = self._reduce_group([c for c, _ in compressed])
                for i, value, (_, context) in zip(members, reduced, compressed):
                    results[i] = self.compression.decompress(value, context)
        return results

    def _choice(self, i, gradients, variables):
        """(gradient i's name, the GradientCompressor chosen for it or None)."""
        variable = None if variables is None else variables[i]
        name = getattr(variable, "path", None) or getattr(variable, "name", None) \
            or f"gradient.{i}"
        if self.choose is None:
            return name, None
        shape = tf.convert_to_tensor(gradients[i]).shape
        return name, self.choose(name, shape) if shape.is_fully_defined() else None

    def _agree(self, choices):
        """An op, run before the exchanges, that fails on every rank unless every
        rank chose the same compressor, with the same settings, for each gradient
        (else payloads that cannot be read together meet, or an exchange waits
        forever for a rank that sends the gradient uncompressed).

        With a choice per gradient it checks every step: a rank may trace its
        step again alone (a last, smaller batch), and a choice may depend on
        the shape. Without one, the ranks check once per process set: once
        they agreed that no rank chooses (an unchosen gradient says
        "uncompressed", a chooser's "uncompressed by choice"), every rank
        knows that none does, so all of them skip the check from then on.
        """
        if self.process_set.size() == 1 or not choices:
            return []
        unchosen = "uncompressed" if self.choose is None else "uncompressed by choice"
        settings = {i: unchosen if compressor is None else repr(compressor)
                    for i, (_, compressor) in choices.items()}
        labels = {i: f"the compressor of '{name}'" for i, (name, _) in choices.items()}
        name = graph_op.collective_name(None, "compression") or "mpitrain.compression"
        process_set_id = self.process_set.process_set_id

        def body(arrays):
            if self.choose is None and process_set_id in _AGREED_THAT_NONE_CHOOSES:
                return arrays
            require_same("compression=...", settings, name, self.process_set,
                         labels=labels)
            if self.choose is None:
                _AGREED_THAT_NONE_CHOOSES.add(process_set_id)
            return arrays
        return graph_op.run(body, [tf.zeros((), tf.int32)], [tf.int32], [()],
                            "compression check")

    def _compressed(self, i, name, gradient, compressor):
        """Gradient i reduced through its compressor."""
        gradient = tf.convert_to_tensor(gradient)
        divisor = self.process_set.size() if self.op == Average else 1
        # Unnamed tf.Variables share a name: the position keeps their state apart.
        key = f"{i}.{name}"
        self.compressors[i] = (key, compressor)
        if i in self.loaded:
            state, own = self.loaded.pop(i)
            _check_saved_shape(state, name, gradient.shape)
            compressor.load_state(key, state, own)

        def body(arrays):
            total, _ = compressor.exchange(arrays[0], key, self.process_set)
            return [(total / divisor).astype(arrays[0].dtype)]
        return graph_op.run(body, [gradient], [gradient.dtype], [gradient.shape],
                            "compressed allreduce")[0]

    def _reduce_group(self, tensors):
        """One op; the gradients of each dtype go together (reduce_arrays)."""
        name = graph_op.collective_name(None, "gradients")

        def body(arrays):
            results = [None] * len(arrays)
            by_dtype = {}
            for i, array in enumerate(arrays):
                by_dtype.setdefault(array.dtype, []).append(i)
            for dtype, members in by_dtype.items():
                part = None if name is None else f"{name}.{dtype.name}"
                values = self.reduce_arrays([arrays[i] for i in members], part)
                for i, value in zip(members, values):
                    results[i] = value
            return results
        return graph_op.run(body, tensors, [t.dtype for t in tensors],
                            [t.shape for t in tensors], "allreduce")

    def reduce_arrays(self, arrays, name):
        """Reduce numpy arrays of one dtype together, as one op's body does.

        Float32/float64 host gradients are packed into one buffer that the
        engine reduces in place and TensorFlow adopts views of, unless the
        engine streams them through shared memory: a grouped allreduce then
        reads them where they lie and writes results TensorFlow adopts, and
        packing would only add a copy. Adasum combines each tensor alone: a
        packed buffer would hide where one ends.
        """
        packable = (arrays[0].dtype in PACKABLE and type(arrays[0]) is np.ndarray
                    and self.op != Adasum
                    and not streamed(self.process_set, sum(a.nbytes for a in arrays)))
        reduce = self.packed.reduce if packable else allreduce_arrays
        return reduce(arrays, name, self.op, self.prescale, self.postscale,
                      self.process_set)

    def _split(self, indices, variables):
        if not indices:
            return []
        if not self.groups:
            return [indices]
        if isinstance(self.groups, int):
            count = min(self.groups, len(indices))
            size, extra = divmod(len(indices), count)
            bounds = [k * size + min(k, extra) for k in range(count + 1)]
            return [indices[bounds[k]:bounds[k + 1]] for k in range(count)]
        if variables is None:
            raise ValueError("groups given as lists of variables need the variables "
                             "the gradients belong to")
        group_of = {id(v): k for k, group in enumerate(self.groups) for v in group}
        split = [[] for _ in range(len(self.groups) + 1)]
        for i in indices:
            split[group_of.get(id(variables[i]), len(self.groups))].append(i)
        return [members for members in split if members]


def _divided(gradient, divisor):
    """``gradient`` / divisor; an IndexedSlices (an Embedding's gradient) stays one."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values / divisor, gradient.indices,
                                gradient.dense_shape)
    return gradient / divisor


def _check_saved_shape(state, name, shape):
    """ValueError (on every rank: each holds the saved state) if a checkpoint's
    residual does not fit the gradient it is loaded for."""
    residual = state.get("residual")
    if residual is not None and tuple(residual.shape) != tuple(shape):
        raise ValueError(f"the saved compression residual for '{name}' has shape "
                         f"{list(residual.shape)}, its gradient {list(shape)}: the "
                         "checkpoint is of another model")


def local_weights(local_layers):
    """The trainable weights of a Keras layer or a list of them (None: none)."""
    if local_layers is None:
        return []
    if not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    not_layers = [layer for layer in local_layers if not hasattr(layer, "trainable_weights")]
    if not_layers:
        raise ValueError("local_layers must be Keras layers (objects with "
                         f"trainable_weights), got {not_layers!r}")
    return [weight for layer in local_layers for weight in layer.trainable_weights]
