"""Making every rank start from the same model and optimizer state."""

import torch

from mpitrain.api.handles import synchronize_all
from mpitrain.api.objects import allgather_object, broadcast_object
from mpitrain.api.process_sets import global_process_set, is_root
from mpitrain.errors import CollectiveValueError
from mpitrain.torch.ops import broadcast_async_
from mpitrain.torch.optimizers.sharded import state_on_one_rank


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
    handles, errors, seen = [], [], set()
    for name, tensor in items:
        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided \
                and tensor.numel():
            # Tied weights appear under several names: the first fills them all.
            memory = (tensor.device, tensor.data_ptr(), tensor.dtype, tensor.shape,
                      tensor.stride())
            if memory in seen:
                continue
            seen.add(memory)
        try:
            # A tensor this rank cannot send fails its name on every rank.
            handles.append(broadcast_async_(tensor, root_rank, name, process_set))
        except Exception as error:      # submit the rest, so no peer waits for them
            errors.append(error)
    errors += synchronize_all(handles)[1]
    if errors:
        raise errors[0]


def _zero_missing_gradients(optimizer, model):
    """Zero gradients of trainable parameters that have none, as Horovod's
    broadcast_optimizer_state leaves a new optimizer's parameters: code that
    broadcasts a .grad next finds a tensor. Sparse where a step takes them so
    (SparseAdam; SGD on an Embedding(sparse=True) of ``model``)."""
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()


def broadcast_optimizer_state(optimizer, root_rank, model=None,
                              process_set=global_process_set):
    """Give every rank root_rank's optimizer state and options (such as lr).

    Works for every torch.optim optimizer, including state that other ranks
    have not created yet: the whole state_dict travels from the root and is
    loaded elsewhere; if it cannot be loaded on some rank, every rank raises
    CollectiveValueError naming those ranks. As in Horovod, an optimizer
    without state leaves zero gradients on trainable parameters that had none
    (``model`` tells sparse ones). A ShardedOptimizer's full state is first
    gathered on root_rank; each rank keeps its share of it.
    """
    if not optimizer.state:
        _zero_missing_gradients(optimizer, model)
    sends = is_root(root_rank, process_set)
    with state_on_one_rank(optimizer, root_rank):
        state = broadcast_object(optimizer.state_dict() if sends else None, root_rank,
                                 "broadcast_optimizer_state", process_set)
    failure = problem = None
    if not sends:
        try:
            optimizer.load_state_dict(state)
        except Exception as error:          # whatever it is, every rank must hear it
            failure, problem = error, f"{type(error).__name__}: {error}"
    problems = allgather_object(problem, "broadcast_optimizer_state.loaded", process_set)
    failed = [f"rank {rank}: {problem}"
              for rank, problem in zip(process_set.ranks, problems) if problem]
    if failed:
        raise CollectiveValueError(
            f"broadcast_optimizer_state could not load rank {root_rank}'s state on "
            f"every rank (does every rank build the same optimizer?): "
            f"{'; '.join(failed)}") from failure
