"""The names gradients travel under, and the groups reduced together.

DistributedOptimizer and its Adasum form both match parameters across ranks
by name; the groups (``groups=``) are formed from those names the same way
on every rank. A module of its own so that adasum.py, which distributed.py
imports, takes the names without importing distributed.py back.
"""

import torch

from mpitrain.api.objects import broadcast_object


def parameter_names(param_groups, named_parameters):
    """Map each parameter to the name its gradient travels under."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}"
                for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    named_parameters = list(named_parameters)
    if not all(isinstance(item, tuple) and len(item) == 2 for item in named_parameters):
        raise ValueError("named_parameters should be a sequence of (name, parameter) "
                         "tuples, usually model.named_parameters()")
    seen, duplicates = set(), set()
    for name, _ in named_parameters:
        (duplicates if name in seen else seen).add(name)
    if duplicates:
        raise ValueError("parameter names in named_parameters must be unique; "
                         f"found duplicates: {', '.join(sorted(duplicates))}")
    names = {p: name for name, p in named_parameters}
    unnamed = [f"group {i} parameter {j} (shape {tuple(p.shape)})"
               for i, group in enumerate(param_groups)
               for j, p in enumerate(group["params"]) if p not in names]
    if unnamed:
        raise ValueError("named_parameters was given but does not name every "
                         f"parameter of the optimizer: missing {'; '.join(unnamed)}")
    return names


def groups_setting(groups, names):
    """``groups`` as the ranks compare it: None, a count, or each group's
    names (of the optimizer's parameters); ValueError where form_groups
    cannot take it."""
    if groups is None:
        return None
    if isinstance(groups, list):
        grouped = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must be a number or a list of lists of "
                                     f"parameters, got a {type(p).__name__} inside")
                if p in grouped:
                    raise ValueError(f"'{names.get(p)}' appears in more than one group")
                grouped.add(p)
        return [[names[p] for p in group if p in names] for group in groups]
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError("groups must be a positive number of groups or a list "
                         f"of lists of parameters, got {groups!r}")
    return groups


def form_groups(trained, groups, names, process_set):
    """Map each grouped parameter to its group (a tuple reduced in one call).

    ``groups`` as groups_setting accepted it, and ``trained`` named alike on
    every rank of ``process_set``.
    """
    if groups is None:
        return {}
    if isinstance(groups, list):
        trained_set = set(trained)
        formed = [tuple(p for p in group if p in trained_set) for group in groups]
    else:
        # Every rank must form the same groups: follow rank 0's parameter order.
        order = broadcast_object([names[p] for p in trained], process_set.ranks[0],
                                 "DistributedOptimizer.parameter_order", process_set)
        by_name = {names[p]: p for p in trained}
        ordered = [by_name[name] for name in order]
        size, extra = divmod(len(ordered), groups)
        formed, start = [], 0
        for index in range(groups):
            end = start + size + (1 if index < extra else 0)
            formed.append(tuple(ordered[start:end]))
            start = end
    return {p: group for group in formed if group for p in group}
