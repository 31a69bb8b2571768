"""Saving a Keras model's training state from rank 0, and resuming from it.

The file is an .npz archive of plain arrays (the model's weights, then the
optimizer's variables) plus ``extra`` as JSON, so loading it runs no pickle.
"""

import json

import numpy as np

from mpitrain import checkpoint
from mpitrain.objects import broadcast_object
from mpitrain.tensorflow.broadcast import broadcast_variables
from mpitrain.tensorflow.keras.variables import optimizer_variables


def save_checkpoint(path, model, optimizer=None, root_rank=0, **extra):
    """Every rank calls this; root_rank saves the state to ``path`` atomically.

    ``optimizer`` defaults to the model's; ``extra`` holds JSON values (the
    epoch, the step). A crash while saving leaves the previous checkpoint.
    """
    optimizer = optimizer or getattr(model, "optimizer", None)

    def write(stream):
        arrays = {f"model.{i}": w for i, w in enumerate(model.get_weights())}
        arrays.update({f"optimizer.{i}": np.asarray(v) for i, v
                       in enumerate(optimizer_variables(optimizer))})
        np.savez(stream, extra=np.array(json.dumps(extra)), **arrays)

    checkpoint.save_on_root(path, write, root_rank)


def load_checkpoint(path, model, optimizer=None, root_rank=0):
    """Every rank calls this: resume from ``path``, or start from the root's state.

    If ``path`` exists on root_rank, the root loads it into the model and
    the optimizer (building the optimizer if it has not taken a step yet).
    Either way every rank then gets the root's variables. Returns the
    ``extra`` values saved with the checkpoint, or None without one.
    """
    optimizer = optimizer or getattr(model, "optimizer", None)

    def restore(found_path):
        with np.load(found_path, allow_pickle=False) as saved:
            model.set_weights(_numbered(saved, "model"))
            state = _numbered(saved, "optimizer")
            if optimizer is not None and state:
                _build(optimizer, model)
                variables = optimizer_variables(optimizer)
                if len(variables) != len(state):
                    raise ValueError(f"the checkpoint holds {len(state)} optimizer "
                                     f"variables, the optimizer has {len(variables)}")
                for variable, value in zip(variables, state):
                    variable.assign(value)
            return {"extra": json.loads(str(saved["extra"])),
                    "optimizer_state": bool(state)}

    found, restored = checkpoint.read_on_root(path, restore, root_rank)
    restored = broadcast_object(restored, root_rank, "mpitrain.checkpoint.extra")
    if restored and restored["optimizer_state"] and optimizer is not None:
        _build(optimizer, model)             # every rank, so the variables match
    broadcast_variables(list(model.variables) + optimizer_variables(optimizer), root_rank)
    return restored["extra"] if found else None


def _numbered(saved, prefix):
    count = sum(1 for key in saved.files if key.startswith(prefix + "."))
    return [saved[f"{prefix}.{i}"] for i in range(count)]


def _build(optimizer, model):
    if not getattr(optimizer, "built", True):
        optimizer.build(model.trainable_variables)
