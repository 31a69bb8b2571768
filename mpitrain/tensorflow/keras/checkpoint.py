"""Saving a Keras model's training state from rank 0, and resuming from it.

The file's payload is an .npz archive of plain arrays (the model's weights,
then the optimizer's variables, then the root's compression state: error
feedback's residuals and PowerSGD's Q) plus ``extra`` and the index of the
compression arrays as JSON, so loading it runs no pickle.
"""

import io
import json

import numpy as np

from mpitrain.api import checkpoint
from mpitrain.tensorflow.broadcast import broadcast_variables
from mpitrain.tensorflow.keras.optimizer import gradient_reducer
from mpitrain.tensorflow.keras.variables import optimizer_variables


def save_checkpoint(path, model, optimizer=None, root_rank=0, **extra):
    """Every rank calls this; root_rank saves the state to ``path`` atomically.

    ``optimizer`` defaults to the model's; ``extra`` holds JSON values (the
    epoch, the step). A crash while saving leaves the previous checkpoint.
    """
    optimizer = optimizer or getattr(model, "optimizer", None)

    def serialize():
        arrays = {f"model.{i}": w for i, w in enumerate(model.get_weights())}
        arrays.update({f"optimizer.{i}": np.asarray(v) for i, v
                       in enumerate(optimizer_variables(optimizer))})
        index, compression = _compression_arrays(optimizer)
        arrays.update({f"compression.{i}": value for i, value in enumerate(compression)})
        buffer = io.BytesIO()
        np.savez(buffer, extra=np.array(json.dumps(extra)),
                 compression=np.array(json.dumps(index)), **arrays)
        return buffer.getvalue()

    checkpoint.save_on_root(path, serialize, root_rank)


def load_checkpoint(path, model, optimizer=None, root_rank=0):
    """Every rank calls this: resume from ``path``, or start from the root's state.

    If ``path`` exists on root_rank, the root loads it into the model and
    the optimizer (building the optimizer if it has not taken a step yet).
    Either way every rank then gets the root's variables. Returns the
    ``extra`` values saved with the checkpoint, or None without one. A
    checkpoint that does not load (corrupt, or of another model or
    optimizer) raises CheckpointError on every rank and changes no rank's
    weights or optimizer state.
    """
    optimizer = optimizer or getattr(model, "optimizer", None)

    def restore(payload):
        with np.load(io.BytesIO(payload), allow_pickle=False) as saved:
            weights, state = _numbered(saved, "model"), _numbered(saved, "optimizer")
            extra = json.loads(str(saved["extra"]))
            compression = _compression_state(saved)
        parts = [("model", list(model.weights), weights)]
        if optimizer is not None and state:
            # Built with zeros, as every rank's is at its first step, even if
            # the checkpoint turns out not to fit.
            _build(optimizer, model)
            parts.append(("optimizer", optimizer_variables(optimizer), state))
        for owner, variables, values in parts:
            _check_fit(owner, variables, values)
        for _, variables, values in parts:
            for variable, value in zip(variables, values):
                variable.assign(value)
        return {"extra": extra, "optimizer_state": bool(state), "compression": compression}

    # read_on_root hands the root's result, compression state included, to every rank.
    found, restored = checkpoint.read_on_root(path, restore, root_rank)
    if restored and restored["optimizer_state"] and optimizer is not None:
        _build(optimizer, model)             # every rank, so the variables match
    reducer = gradient_reducer(optimizer)
    if restored and restored["compression"] and reducer is not None:
        reducer.load_compression_state(restored["compression"])
    broadcast_variables(list(model.variables) + optimizer_variables(optimizer), root_rank)
    return restored["extra"] if found else None


def _compression_arrays(optimizer):
    """A DistributedOptimizer's compression state as an index for JSON (the
    rank, and each array's key and field) and the arrays, in its order:
    Keras paths hold "/", which an .npz name cannot."""
    reducer = gradient_reducer(optimizer)
    state = reducer.compression_state() if reducer is not None else None
    if state is None:
        return {}, []
    fields = [(key, field, value) for key, values in state["parameters"].items()
              for field, value in values.items()]
    return ({"rank": state["rank"], "fields": [[key, field] for key, field, _ in fields]},
            [np.asarray(value) for _, _, value in fields])


def _compression_state(saved):
    """_compression_arrays' state back, or None (none saved, or an older file)."""
    index = json.loads(str(saved["compression"])) if "compression" in saved.files else {}
    if "rank" not in index:
        return None
    parameters = {}
    for (key, field), value in zip(index["fields"], _numbered(saved, "compression")):
        parameters.setdefault(key, {})[field] = value
    return {"rank": index["rank"], "parameters": parameters}


def _numbered(saved, prefix):
    count = sum(1 for key in saved.files if key.startswith(prefix + "."))
    return [saved[f"{prefix}.{i}"] for i in range(count)]


def _check_fit(owner, variables, values):
    """Raise ValueError unless ``values`` fit ``variables``, shape for shape."""
    if len(variables) != len(values):
        raise ValueError(f"the checkpoint holds {len(values)} {owner} variables, "
                         f"the {owner} has {len(variables)}")
    for variable, value in zip(variables, values):
        if tuple(variable.shape) != value.shape:
            name = getattr(variable, "path", variable.name)    # Keras 3, tf_keras
            raise ValueError(f"{owner} variable {name} has shape "
                             f"{tuple(variable.shape)}, the checkpoint's {value.shape}")


def _build(optimizer, model):
    if not getattr(optimizer, "built", True):
        optimizer.build(model.trainable_variables)
