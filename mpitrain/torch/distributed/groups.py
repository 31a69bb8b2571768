"""Making "mpitrain" process groups: the default group, and dist.new_group's.

torch builds a backend's group on the group's members alone, but an mpitrain
process set is registered on every rank of the job. So subgroups are made
where torch asks every rank: when the default group is an mpitrain group,
``dist.new_group(ranks)`` calls its ``new_group`` on every rank (torch's hook
for process groups that make their own), which registers the process set
everywhere and returns the group to its members. A subgroup of another
backend asked of that hook (``new_group(backend="gloo")``) is made as torch
makes it. With another default backend, an mpitrain group can span the
whole job only.
"""

import sys

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from mpitrain.api import basics
from mpitrain.api.process_sets import global_process_set
from mpitrain.api.set_registry import add_process_set
from mpitrain.torch.distributed.excepthook import keep_tracebacks
from mpitrain.torch.distributed.process_group import BACKEND_NAME, MpitrainProcessGroup
from mpitrain.torch.distributed.rendezvous import check_place, start_mpitrain


def create(options, backend_options=None):
    """torch's creator of "mpitrain" groups (registered with extended_api=True)."""
    start_mpitrain()
    ranks = list(options.global_ranks_in_group)
    if not ranks:                                   # the default group
        check_place(options.group_rank, options.group_size,
                    "init_process_group('mpitrain')")
        process_set = global_process_set
        keep_tracebacks()                           # torch's excepthook comes next
    elif ranks == list(range(basics.size())):
        process_set = global_process_set
    else:
        process_set = _registered(ranks)
        if process_set is None:
            raise ValueError(
                f"dist.new_group(ranks={ranks}, backend='mpitrain') needs 'mpitrain' "
                "as the default group's backend too (init_process_group('mpitrain')): "
                "mpitrain makes a process set on every rank of the job, and torch "
                "asks only the new group's members unless the default group is an "
                "mpitrain group")
    kind = DefaultGroup if not ranks else MpitrainProcessGroup
    return kind(options.group_rank, options.group_size, process_set, options.group_id,
                options.timeout, options.store)


def _registered(ranks):
    for process_set in basics.registered_sets().values():
        if process_set.ranks == ranks:
            return process_set
    return None


def _requested_backend():
    """The backend dist.new_group was asked for: torch passes it to the hook's
    caller only (torch/distributed/distributed_c10d.py, _new_group_with_tag)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_new_group_with_tag":
        frame = frame.f_back
    return str(frame.f_locals.get("backend", BACKEND_NAME)) if frame else BACKEND_NAME


class DefaultGroup(MpitrainProcessGroup):
    """The default group, which makes the job's subgroups."""

    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None,
                  group_desc=None):
        return new_group(self, ranks, timeout, pg_options, group_name, group_desc)


def new_group(default, ranks, timeout=None, pg_options=None, group_name=None,
              group_desc=None):
    """dist.new_group on every rank, with an mpitrain default group ``default``."""
    ranks = sorted(ranks)
    backend = _requested_backend()
    me = default.rank()
    if backend != BACKEND_NAME:
        group, _ = c10d._new_process_group_helper(
            len(ranks), ranks.index(me) if me in ranks else None, ranks,
            dist.Backend(backend), c10d._world.pg_map[default][1], group_name,
            backend_options=pg_options, timeout=timeout, group_desc=group_desc)
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return None
        # torch registers the name again once the hook returns, and refuses twice
        c10d._unregister_process_group(group_name)
        return group
    if ranks == list(range(default.size())):
        process_set = global_process_set
    else:
        process_set = _registered(ranks) or add_process_set(ranks)
    if me not in ranks:
        return None
    group = MpitrainProcessGroup(ranks.index(me), len(ranks), process_set, group_name,
                                 timeout, dist.PrefixStore(f"{group_name}/", default.store))
    group._set_group_name(group_name)
    return group
