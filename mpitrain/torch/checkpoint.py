"""Saving training state from rank 0, and resuming from it on every rank."""

import torch

from mpitrain import checkpoint
from mpitrain.objects import broadcast_object
from mpitrain.torch.functions import broadcast_optimizer_state, broadcast_parameters


def save_checkpoint(path, model, optimizer=None, root_rank=0, **extra):
    """Every rank calls this; root_rank saves the state to ``path`` atomically.

    The file holds the model's state_dict, the optimizer's, and ``extra``
    (the step, the epoch, RNG states: anything ``torch.load(weights_only=True)``
    reads back). A crash while saving leaves the previous checkpoint intact.
    """
    def write(stream):
        torch.save({"model": model.state_dict(),
                    "optimizer": None if optimizer is None else optimizer.state_dict(),
                    "extra": extra}, stream)

    checkpoint.save_on_root(path, write, root_rank)


def load_checkpoint(path, model, optimizer=None, root_rank=0):
    """Every rank calls this: resume from ``path``, or start from the root's state.

    If ``path`` exists on root_rank, the root loads it into the model and
    the optimizer. Either way, every rank then gets the root's parameters,
    buffers and optimizer state, so this also replaces the usual
    broadcast_parameters / broadcast_optimizer_state at start-up. Returns
    the ``extra`` values saved with the checkpoint, or None without one.
    """
    def restore(found_path):
        saved = torch.load(found_path, weights_only=True)
        model.load_state_dict(saved["model"])
        if optimizer is not None and saved["optimizer"] is not None:
            optimizer.load_state_dict(saved["optimizer"])
        return saved["extra"]

    found, extra = checkpoint.read_on_root(path, restore, root_rank)
    broadcast_parameters(model.state_dict(), root_rank)
    if optimizer is not None:
        broadcast_optimizer_state(optimizer, root_rank)
    if not found:
        return None
    return broadcast_object(extra, root_rank, "mpitrain.checkpoint.extra")
