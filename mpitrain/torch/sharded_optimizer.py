"""ShardedOptimizer: ZeRO stage 1, the optimizer state split across ranks.

Each trained parameter belongs to one rank, chosen greedily by size so that
every rank owns about 1/N of the bytes (as PyTorch's ZeroRedundancyOptimizer
does): whole parameters, never slices of one, so any torch optimizer runs
unchanged on its rank's parameters, including those whose update depends on
a whole tensor (LAMB, LARS, Adafactor). step() reduce-scatters the
gradients so that each rank receives the average of those it owns, lets a
local optimizer update them, and allgathers the updated parameters. Each
dtype travels in one flat buffer, split into N equal segments: segment r
holds rank r's parameters back to back (padded to the longest segment).
"""

import contextlib
import pickle
from collections import defaultdict

import numpy as np
import torch

from mpitrain.api import basics
from mpitrain.api.objects import allgather_object
from mpitrain.engine.handles import synchronize
from mpitrain.ops import Average
from mpitrain.torch.ops import (alltoall_async, grouped_allgather_async,
                                grouped_reducescatter_async)


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over ``params``, its state sharded across the ranks.

    Use it where a DistributedOptimizer would go (not inside one): it
    averages the gradients itself, in step(). Every rank must build it with
    the same parameters. ``param_groups`` holds every parameter, and what
    changes a group's options (an LR scheduler) reaches the local optimizer
    at the next step(). ``state`` holds only this rank's parameters' state.

    state_dict() is collective: every rank calls it and gets the full state,
    in the format of ``optimizer_class``'s own state_dict. After
    consolidate_state_dict(to=r), only rank r may call it, and gets the
    state gathered there, until the next step().
    """

    def __init__(self, optimizer_class, params, **defaults):
        groups = _as_groups(params)
        self._size, self._rank = basics.size(), basics.rank()
        everything = [p for group in groups for p in group["params"]]
        _check_same_everywhere(everything, groups)
        trained = [p for p in everything if p.requires_grad]
        owner = _owners(trained, self._size)
        self._local = optimizer_class(
            [{**group, "params": [p for p in group["params"] if owner.get(p) == self._rank]}
             for group in groups], **defaults)
        # The global groups take every option the local optimizer filled in.
        super().__init__([{**local, "params": group["params"]}
                          for local, group in zip(self._local.param_groups, groups)],
                         self._local.defaults)
        self.state = self._local.state
        self._layouts = _layouts(trained, owner, self._size)
        self._index = {p: i for i, p in enumerate(everything)}
        # After consolidate_state_dict: the rank that holds the full state, and
        # there, that state by parameter index.
        self._consolidated_on, self._consolidated = None, None
        self._built = True

    # -- step ------------------------------------------------------------------

    def step(self, closure=None):
        """Average the gradients, update this rank's parameters, share them.

        A closure is evaluated once, before the gradients are averaged:
        optimizers that evaluate it several times per step (LBFGS) are not
        supported.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self._local.param_groups):
            local.update(_options(group))
        # Alone, a rank's gradients are their own average and it owns everything.
        exchange = self._size > 1 and self._layouts
        if exchange:
            self._average_gradients()
        self._local.step()
        if exchange:
            self._share_parameters()
        self._consolidated_on, self._consolidated = None, None
        return loss

    def _average_gradients(self):
        flats = []
        for layout in self._layouts:
            flat = torch.zeros(self._size * layout.segment, dtype=layout.dtype,
                               device=layout.device)
            for p, start in layout.starts:
                if p.grad is not None:
                    grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                    flat[start:start + p.numel()].copy_(grad.reshape(-1))
            flats.append(flat)
        shards = synchronize(grouped_reducescatter_async(
            flats, name="ShardedOptimizer.gradients", op=Average))
        for layout, shard in zip(self._layouts, shards):
            for p, start in layout.mine:
                averaged = shard[start:start + p.numel()].view_as(p)
                if p.grad is None or p.grad.is_sparse:
                    p.grad = averaged.clone()
                else:
                    p.grad.copy_(averaged)

    @torch.no_grad()
    def _share_parameters(self):
        segments = []
        for layout in self._layouts:
            segment = torch.zeros(layout.segment, dtype=layout.dtype, device=layout.device)
            for p, start in layout.mine:
                segment[start:start + p.numel()].copy_(p.reshape(-1))
            segments.append(segment)
        gathered = synchronize(grouped_allgather_async(
            segments, name="ShardedOptimizer.parameters"))
        for layout, flat in zip(self._layouts, gathered):
            for p, start in layout.theirs:
                p.copy_(flat[start:start + p.numel()].view_as(p))

    # -- state -----------------------------------------------------------------

    def consolidate_state_dict(self, to=0):
        """Gather the full state on rank ``to`` only; every rank calls this.

        Afterwards state_dict() on rank ``to`` returns it without
        communicating, and raises on the other ranks, until the next step().
        Calling it again before a step gathers nothing.
        """
        if not isinstance(to, int) or not 0 <= to < self._size:
            raise ValueError(f"consolidate_state_dict: to must be a rank from 0 to "
                             f"{self._size - 1}, got {to!r}")
        if self._consolidated_on == to:
            return
        shard = np.frombuffer(pickle.dumps(self._shard_state(), protocol=5), np.uint8)
        splits = np.zeros(self._size, np.int32)
        splits[to] = shard.size
        received, sizes = synchronize(alltoall_async(
            torch.from_numpy(shard.copy()), torch.from_numpy(splits),
            name="ShardedOptimizer.consolidate"))
        state = {}
        if self._rank == to:
            for piece in received.split(sizes.tolist()):
                state.update(pickle.loads(piece.numpy().tobytes()))
        self._consolidated_on, self._consolidated = to, state

    def state_dict(self):
        """The full state; collective unless consolidate_state_dict came first."""
        to, state = self._consolidated_on, self._consolidated
        if to is None:
            state = {}
            for shard in allgather_object(self._shard_state(),
                                          "ShardedOptimizer.state_dict"):
                state.update(shard)
        elif self._rank != to:
            raise RuntimeError(
                f"ShardedOptimizer.state_dict() on rank {self._rank}: the state was "
                f"consolidated on rank {to} by consolidate_state_dict(to={to}), so "
                f"only rank {to} has it until the next step(); call state_dict() "
                f"there, or on every rank after a step()")
        return {"state": dict(sorted(state.items())),
                "param_groups": [
                    {**_options(group), "params": [self._index[p] for p in group["params"]]}
                    for group in self.param_groups]}

    def _shard_state(self):
        """This rank's state, keyed by the parameters' indices in param_groups."""
        local = self._local.state_dict()
        ids = [p for group in self._local.param_groups for p in group["params"]]
        return {self._index[ids[i]]: state for i, state in local["state"].items()}

    def load_state_dict(self, state_dict):
        """Take a full state (of ``optimizer_class`` or a ShardedOptimizer) and
        keep this rank's share of it; every rank calls it with the same state."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(saved["params"]) != len(group["params"])
                for saved, group in zip(groups, self.param_groups)):
            raise ValueError(
                "ShardedOptimizer.load_state_dict: the state has groups of "
                f"{[len(g['params']) for g in groups]} parameters, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}")
        order = [i for group in groups for i in group["params"]]
        position = {saved: self._index[p] for saved, p in zip(
            order, (p for group in self.param_groups for p in group["params"]))}
        state = {position[i]: value for i, value in state_dict["state"].items()}
        local_index = {p: i for i, p in enumerate(
            p for group in self._local.param_groups for p in group["params"])}
        self._local.load_state_dict({
            "state": {local_index[p]: state[self._index[p]]
                      for p in local_index if self._index[p] in state},
            "param_groups": [
                {**_options(saved), "params": [local_index[p] for p in local["params"]]}
                for saved, local in zip(groups, self._local.param_groups)]})
        for saved, group in zip(groups, self.param_groups):
            group.update(_options(saved))
        self.state = self._local.state
        if self._consolidated_on == self._rank:
            self._consolidated = state

    def add_param_group(self, param_group):
        if getattr(self, "_built", False):
            raise ValueError("add_param_group() on a ShardedOptimizer would need the "
                             "parameters sharded again: give every group to the "
                             "constructor")
        super().add_param_group(param_group)


@contextlib.contextmanager
def state_on_one_rank(optimizer, rank):
    """Inside, state_dict() on ``rank`` alone returns ``optimizer``'s full state.

    For helpers that read the state on one rank (save_checkpoint): a
    ShardedOptimizer's is gathered there, unless it already was, and
    state_dict() is collective again afterwards. Every rank enters it.
    """
    if not isinstance(optimizer, ShardedOptimizer) or optimizer._consolidated_on == rank:
        yield
        return
    optimizer.consolidate_state_dict(to=rank)
    try:
        yield
    finally:
        optimizer._consolidated_on, optimizer._consolidated = None, None


def _options(group):
    """A parameter group's options: everything but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


class _Layout:
    """Where each parameter of one dtype sits in the flat buffer of N segments."""

    def __init__(self, dtype, device, segment, places, rank):
        """places: (parameter, owner, offset in the owner's segment)."""
        self.dtype, self.device, self.segment = dtype, device, segment
        self.starts = [(p, owner * segment + offset) for p, owner, offset in places]
        self.mine = [(p, offset) for p, owner, offset in places if owner == rank]
        self.theirs = [(p, owner * segment + offset) for p, owner, offset in places
                       if owner != rank]


def _as_groups(params):
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


def _check_same_everywhere(parameters, groups):
    """Raise on every rank unless every rank has the same groups of parameters."""
    mine = [f"group sizes {[len(g['params']) for g in groups]}"] + [
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


def _entry(entries, index):
    return entries[index] if index < len(entries) else "nothing more"


def _owners(parameters, size):
    """Each parameter's rank: the largest first, each to the least loaded rank."""
    load = [0] * size
    owner = {}
    for p in sorted(parameters, key=lambda p: -p.numel() * p.element_size()):
        rank = load.index(min(load))
        owner[p] = rank
        load[rank] += p.numel() * p.element_size()
    return owner


def _layouts(parameters, owner, size):
    by_dtype = defaultdict(list)
    for p in parameters:
        by_dtype[p.dtype].append(p)
    layouts = []
    for dtype in sorted(by_dtype, key=str):
        filled = [0] * size
        places = []
        for p in by_dtype[dtype]:
            places.append((p, owner[p], filled[owner[p]]))
            filled[owner[p]] += p.numel()
        layouts.append(_Layout(dtype, by_dtype[dtype][0].device, max(filled), places,
                               basics.rank()))
    return layouts
