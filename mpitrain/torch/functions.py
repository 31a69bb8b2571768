"""Making every rank start from the same model and optimizer state."""

from mpitrain.handles import synchronize
from mpitrain.objects import broadcast_object
from mpitrain.process_sets import global_process_set
from mpitrain.torch.ops import broadcast_async_


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrite tensors in place with root_rank's.

    ``params`` is a state_dict (``model.state_dict()``), named parameters
    (``model.named_parameters()``), or tensors. Names, where given, match the
    tensors across ranks; unnamed tensors match by position.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = [broadcast_async_(tensor, root_rank, name, process_set)
               for name, tensor in items]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(optimizer, root_rank, model=None,
                              process_set=global_process_set):
    """Give every rank root_rank's optimizer state and options (such as lr).

    Works for every torch.optim optimizer, including state that other ranks
    have not created yet: the whole state_dict travels from the root and is
    loaded elsewhere. ``model`` is accepted for Horovod compatibility.
    """
    is_root = process_set.rank() == root_rank
    state = broadcast_object(optimizer.state_dict() if is_root else None, root_rank,
                             "broadcast_optimizer_state", process_set)
    if not is_root:
        optimizer.load_state_dict(state)
