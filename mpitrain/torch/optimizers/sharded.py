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

from mpitrain.api import array_ops, basics
from mpitrain.api.agreement import require_same
from mpitrain.api.handles import synchronize
from mpitrain.api.objects import allgather_object
from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Average, OpType
from mpitrain.torch.ops import (alltoall_async, grouped_allgather_async,
                                grouped_reducescatter_async)


GRADIENTS, PARAMETERS = "ShardedOptimizer.gradients", "ShardedOptimizer.parameters"


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over ``params``, its state sharded across the ranks.

    Use it where a DistributedOptimizer would go (not inside one): it
    averages the gradients itself, in step(). Every rank must build it with
    the same parameters. ``param_groups`` holds every parameter, and what
    changes a group's options (an LR scheduler) reaches the local optimizer
    at the next step(). ``state`` holds only this rank's parameters' state.

    As with torch's ZeroRedundancyOptimizer, state_dict() returns the full
    state, in the format of ``optimizer_class``'s own state_dict, on the
    rank that consolidate_state_dict(to=r) gathered it on, until the next
    step(); anywhere else it raises at once, saying what to call: a rank
    that waited alone for the others' shards would wait forever.
    full_state_dict() gives it to every rank (every rank calls it).
    """

    def __init__(self, optimizer_class, params, **defaults):
        groups = _as_groups(params)
        self._size, self._rank = basics.size(), basics.rank()
        everything = [p for group in groups for p in group["params"]]
        _check_same_everywhere(everything, groups)
        trained = [p for p in everything if p.requires_grad]
        owner = _owners(trained, self._size)
        try:
            self._local, problem = optimizer_class(
                [{**group, "params": [p for p in group["params"]
                                      if owner.get(p) == self._rank]}
                 for group in groups], **defaults), None
        except Exception as error:    # an option refused here fails every rank
            self._local, problem = None, error
        _check_same_options(self._local, problem)
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
        for group, local in zip(self.param_groups, self._local.param_groups):
            local.update(_options(group))
        self._consolidated_on, self._consolidated = None, None
        # Alone, a rank's gradients are their own average and it owns everything.
        if self._size == 1 or not self._layouts:
            loss = _loss(closure)
            self._local.step()
            return loss
        loss, flats = self._for_every_rank(OpType.REDUCESCATTER, GRADIENTS, lambda: (
            _loss(closure), self._flat_gradients()))
        self._take_averages(synchronize(grouped_reducescatter_async(
            flats, name=GRADIENTS, op=Average)))
        segments = self._for_every_rank(OpType.ALLGATHER, PARAMETERS, self._update)
        self._take_parameters(synchronize(grouped_allgather_async(segments,
                                                                  name=PARAMETERS)))
        return loss

    def _for_every_rank(self, kind, name, work):
        """work()'s result. Where it raises on this rank, the collective
        ``name`` that comes next fails on every rank with its error, instead
        of leaving the other ranks waiting in it for this one."""
        try:
            return work()
        except Exception as error:
            array_ops.fail(kind, name, global_process_set, "value",
                           f"ShardedOptimizer.step() raised {type(error).__name__}: "
                           f"{error}", count=len(self._layouts))

    def _flat_gradients(self):
        flats = []
        for layout in self._layouts:
            flat = torch.zeros(self._size * layout.segment, dtype=layout.dtype,
                               device=layout.device)
            for p, start in layout.starts:
                if p.grad is not None:
                    grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                    flat[start:start + p.numel()].copy_(grad.reshape(-1))
            flats.append(flat)
        return flats

    def _take_averages(self, shards):
        for layout, shard in zip(self._layouts, shards):
            for p, start in layout.mine:
                averaged = shard[start:start + p.numel()].view_as(p)
                if p.grad is None or p.grad.is_sparse:
                    p.grad = averaged.clone()
                else:
                    p.grad.copy_(averaged)

    def _update(self):
        """Step the local optimizer; this rank's updated parameters, a segment per dtype."""
        self._local.step()
        segments = []
        with torch.no_grad():
            for layout in self._layouts:
                segment = torch.zeros(layout.segment, dtype=layout.dtype,
                                      device=layout.device)
                for p, start in layout.mine:
                    segment[start:start + p.numel()].copy_(p.reshape(-1))
                segments.append(segment)
        return segments

    @torch.no_grad()
    def _take_parameters(self, gathered):
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
        """The full state, where consolidate_state_dict gathered it; it does
        not communicate."""
        if self._size == 1:
            return self._full(self._shard_state())
        to, me = self._consolidated_on, self._rank
        if to != me:
            where = ("it was not gathered since the last step()" if to is None else
                     f"consolidate_state_dict(to={to}) gathered it on rank {to}, which "
                     "alone has it until the next step()")
            raise RuntimeError(
                f"ShardedOptimizer.state_dict() on rank {me}: each of the {self._size} "
                f"ranks holds a share of the state, and {where}. Call "
                f"optimizer.consolidate_state_dict(to={me}) on every rank first, then "
                f"state_dict() on rank {me} (as with torch's ZeroRedundancyOptimizer); "
                "or hvd.save_checkpoint(path, model, optimizer) on every rank, which "
                "does both; or optimizer.full_state_dict() on every rank, to have the "
                "state on each")
        return self._full(self._consolidated)

    def full_state_dict(self):
        """The full state on every rank: every rank calls this."""
        state = {}
        for shard in allgather_object(self._shard_state(), "ShardedOptimizer.state_dict"):
            state.update(shard)
        return self._full(state)

    def _full(self, state):
        """The state_dict of ``optimizer_class`` with ``state`` by parameter index."""
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
        parameters = [p for group in self.param_groups for p in group["params"]]
        position = {saved: self._index[p] for saved, p in zip(order, parameters)}
        state = {position[i]: value for i, value in state_dict["state"].items()}
        _check_shapes(state, parameters)
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
    state_dict() raises there again afterwards. Every rank enters it.
    """
    if not isinstance(optimizer, ShardedOptimizer) or optimizer._consolidated_on == rank:
        yield
        return
    optimizer.consolidate_state_dict(to=rank)
    try:
        yield
    finally:
        optimizer._consolidated_on, optimizer._consolidated = None, None


def state_everywhere(optimizer):
    """``optimizer``'s full state_dict on every rank, which every rank asks for:
    a ShardedOptimizer's is gathered from its shards."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.full_state_dict()
    return optimizer.state_dict()


def _loss(closure):
    """The closure's loss, None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


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


def _check_shapes(state, parameters):
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


def _check_same_options(local, problem):
    """Raise a MismatchError on every rank unless the local optimizer's group
    options (those given and the defaults filled in) are the same on every
    rank: with lr=0 on one rank, the parameters that rank owns would
    silently never train. problem: why this rank has no local optimizer."""
    settings, labels = {}, {}
    for number, group in enumerate([] if local is None else local.param_groups):
        for key, value in _options(group).items():
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
