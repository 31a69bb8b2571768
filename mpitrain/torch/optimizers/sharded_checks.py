"""ShardedOptimizer's checks that every rank built the same optimizer.

A rank that shards other parameters, or steps them with other options,
would silently train something else, or wait forever in a collective its
peers never start: each check here raises on every rank alike, naming the
parameter or option and the ranks that differ. Both stages (sharded.py)
run them.
"""

import torch

from mpitrain.api import array_ops
from mpitrain.api.agreement import require_same
from mpitrain.api.objects import allgather_object
from mpitrain.api.process_sets import global_process_set


def as_groups(params):
    """``params`` (tensors, or dicts of options with "params") as a list of groups."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params should be an iterable of tensors or dicts, got a "
                        "torch.Tensor")
    groups = list(params)
    if not groups:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return [{**group, "params": [group["params"]] if isinstance(group["params"], torch.Tensor)
             else list(group["params"])} for group in groups]


def for_every_rank(kind, names, work, count=None):
    """work()'s result. Where it raises on this rank, the collectives
    ``names`` (of OpType ``kind``; grouped calls of ``count`` members where
    count is given) that come next fail on every rank with its error,
    instead of leaving the other ranks waiting in them."""
    try:
        return work()
    except Exception as error:
        fail_everywhere(kind, names, error, count)


def fail_everywhere(kind, names, error, count=None):
    """Raise ``error``, failing the collectives ``names`` on every rank with it."""
    if not names:
        raise error
    problem = f"ShardedOptimizer.step() raised {type(error).__name__}: {error}"
    failures = []
    for name in names:
        try:
            array_ops.fail(kind, name, global_process_set, "value", problem, count=count)
        except Exception as failure:    # fail() raises: the next name must fail too
            failures.append(failure)
    raise failures[0] from error


def options(group):
    """A parameter group's options: everything but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def check_same_everywhere(parameters, groups, stage):
    """Raise on every rank unless every rank has the same stage and groups of parameters."""
    mine = [f"stage {stage}", f"group sizes {[len(g['params']) for g in groups]}"] + [
        f"parameter {i}: shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}"
        for i, p in enumerate(parameters)]
    everyone = allgather_object(mine, "ShardedOptimizer.parameters_check")
    differ = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        ours, theirs = everyone[0], everyone[differ[0]]
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                     min(len(ours), len(theirs)))
        raise ValueError(
            f"ShardedOptimizer: ranks {differ} have other parameters than rank 0 "
            f"(rank 0 has {_entry(ours, first)}, rank {differ[0]} has "
            f"{_entry(theirs, first)}); every rank must build the same model")


def check_shapes(state, parameters):
    """Refuse, on every rank alike, a state whose tensors cannot be the state
    of these parameters: the step of the one rank that owns the parameter
    would fail there alone. A state tensor with as many dimensions as its
    parameter must match it, each dimension equal or 1 (Adafactor keeps
    factors of ones); other tensors, scalars (step) among them, are left
    to the step to judge."""
    for index, values in sorted(state.items()):
        p = parameters[index]
        for key, value in values.items():
            if torch.is_tensor(value) and value.dim() == p.dim() and value.dim() and any(
                    have not in (want, 1) for have, want in zip(value.shape, p.shape)):
                raise ValueError(
                    f"ShardedOptimizer.load_state_dict: parameter {index} has shape "
                    f"{tuple(p.shape)}, but its state {key!r} in the state to load has "
                    f"shape {tuple(value.shape)}: the state is of another model, or "
                    "of the parameters in another order. Nothing was loaded")


def check_same_options(local, problem):
    """Raise a MismatchError on every rank unless the local optimizer's group
    options (those given and the defaults filled in) are the same on every
    rank: with lr=0 on one rank, the parameters that rank owns would
    silently never train. problem: why this rank has no local optimizer."""
    settings, labels = {}, {}
    for number, group in enumerate([] if local is None else local.param_groups):
        for key, value in options(group).items():
            settings[number, key] = _plain(value)
            labels[number, key] = f"option {key!r} of parameter group {number}"
    require_same("ShardedOptimizer", settings, "ShardedOptimizer.options", problem=problem,
                 labels=labels)


def _plain(value):
    """An option as a value whose repr says it exactly (a tensor's rounds)."""
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(item) for item in value)
    return value


def _entry(entries, index):
    return entries[index] if index < len(entries) else "nothing more"
