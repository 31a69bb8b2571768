"""Saving training state from rank 0, and resuming from it on every rank."""

import io
import pickle

import torch

from mpitrain.api import checkpoint
from mpitrain.torch.functions import broadcast_optimizer_state, broadcast_parameters
from mpitrain.torch.optimizers.sharded import state_on_one_rank


def save_checkpoint(path, model, optimizer=None, root_rank=0, **extra):
    """Every rank calls this; root_rank saves the state to ``path`` atomically.

    The file holds the model's state_dict, the optimizer's, and ``extra``
    (the step, the epoch, RNG states: anything ``torch.load(weights_only=True)``
    reads back; anything else is refused before the file is touched). A
    crash while saving leaves the previous checkpoint intact. A
    ShardedOptimizer's state is gathered on root_rank and saved whole, as
    its ``optimizer_class`` would save it.
    """
    def serialize():
        state = {"model": model.state_dict(),
                 "optimizer": None if optimizer is None else optimizer.state_dict(),
                 "extra": extra}
        payload = _serialized(state)
        try:
            _deserialized(payload, map_location="meta")   # reads no tensor data
        except pickle.UnpicklingError as error:
            raise TypeError(_why_unloadable(extra)) from error
        return payload

    with state_on_one_rank(optimizer, root_rank):
        checkpoint.save_on_root(path, serialize, root_rank)


def load_checkpoint(path, model, optimizer=None, root_rank=0):
    """Every rank calls this: resume from ``path``, or start from the root's state.

    If ``path`` exists on root_rank, the root loads it into the model and
    the optimizer. Either way, every rank then gets the root's parameters,
    buffers and optimizer state, so this also replaces the usual
    broadcast_parameters / broadcast_optimizer_state at start-up. Returns
    the ``extra`` values saved with the checkpoint, or None without one.
    A checkpoint that does not load (corrupt, or of another model or
    optimizer) raises CheckpointError on every rank and changes no rank's
    model or optimizer. A ShardedOptimizer's state is first gathered on
    root_rank, to be put back there if the load fails.
    """
    def restore(payload):
        saved = _deserialized(payload)
        _load_all_or_nothing(model, optimizer, saved)
        return saved["extra"]

    # The root's load of a ShardedOptimizer takes its share and keeps the
    # whole state there for broadcast_optimizer_state to send.
    with state_on_one_rank(optimizer, root_rank):
        found, extra = checkpoint.read_on_root(path, restore, root_rank)
        broadcast_parameters(model.state_dict(), root_rank)
        if optimizer is not None:
            broadcast_optimizer_state(optimizer, root_rank)
    return extra if found else None


def _serialized(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _deserialized(payload, map_location=None):
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)


def _why_unloadable(extra):
    for key, value in extra.items():
        try:
            _deserialized(_serialized(value), map_location="meta")
        except pickle.UnpicklingError:
            kind = type(value).__qualname__
            if type(value).__module__ != "builtins":
                kind = f"{type(value).__module__}.{kind}"
            return (f"extra value {key!r} (a {kind}) cannot be saved: the "
                    f"torch.load(weights_only=True) of load_checkpoint would refuse "
                    f"it or something in it. Convert it to Python numbers, strings, "
                    f"lists and dicts, or to torch tensors (e.g. int(step), "
                    f"torch.from_numpy(array))")
    return ("the model's or the optimizer's state_dict cannot be saved: the "
            "torch.load(weights_only=True) of load_checkpoint would refuse something "
            "in it")


def _load_all_or_nothing(model, optimizer, saved):
    """Load ``saved`` into the model and optimizer; if any part does not fit,
    put back their previous state (load_state_dict may fail half-way)."""
    model_before = {name: value.clone() for name, value in model.state_dict().items()}
    # optimizer.load_state_dict replaces the state, it does not write into
    # its tensors: the state_dict taken before needs no copy.
    optimizer_before = None if optimizer is None else optimizer.state_dict()
    try:
        model.load_state_dict(saved["model"])
        if optimizer is not None and saved["optimizer"] is not None:
            optimizer.load_state_dict(saved["optimizer"])
    except BaseException:
        model.load_state_dict(model_before)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_before)
        raise
