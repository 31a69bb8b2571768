"""ShardedOptimizer: ZeRO stages 1 and 2, optimizer state (and gradients) split across ranks.

The object users call, as torch's ZeroRedundancyOptimizer: it checks that
every rank built the same optimizer, runs ``optimizer_class`` over this
rank's share of the parameters (the local optimizer), and gathers and
splits the state for state_dict() and load_state_dict(). How the
parameters are shared out and what travels in a step is the stage's:
sharded_stage1.py (whole parameters, gradients averaged in step()) and
sharded_stage2.py (slices of gradient buckets, reduce-scattered while
backward runs).
"""

import contextlib
import pickle

import numpy as np
import torch

from mpitrain.api import basics
from mpitrain.api.handles import synchronize
from mpitrain.api.objects import allgather_object
from mpitrain.ops import Max, Sum
from mpitrain.torch.ops import allreduce_async, alltoall_async
from mpitrain.torch.optimizers.sharded_checks import (
    as_groups, check_same_everywhere, check_same_options, check_shapes, options)
from mpitrain.torch.optimizers.sharded_scaling import unscale_shares, unscaled_by_the_scaler
from mpitrain.torch.optimizers.sharded_stage1 import WholeParameters
from mpitrain.torch.optimizers.sharded_stage2 import DEFAULT_BUCKET_BYTES, SlicedParameters


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over ``params``, its state sharded across the ranks.

    Use it where a DistributedOptimizer would go (not inside one): it
    averages the gradients itself. Every rank must build it with the same
    parameters and stage. ``param_groups`` holds every parameter, and what
    changes a group's options (an LR scheduler) reaches the local optimizer
    at the next step(). ``state`` holds only this rank's state.

    stage=1 (ZeRO-1): each rank keeps every gradient until step(), which
    averages them; the state of each parameter lives on one rank.
    stage=2 (ZeRO-2): each gradient is reduce-scattered while backward
    runs, in buckets of at most ``bucket_bytes``, and a rank keeps only its
    slice of it (``p.grad`` stays None); it steps its slice of every
    parameter. For elementwise optimizers (SGD, Adam, AdamW, ...).

    As with torch's ZeroRedundancyOptimizer, state_dict() returns the full
    state, in the format of ``optimizer_class``'s own state_dict, on the
    rank that consolidate_state_dict(to=r) gathered it on, until the next
    step(); anywhere else it raises at once, saying what to call: a rank
    that waited alone for the others' shards would wait forever.
    full_state_dict() gives it to every rank (every rank calls it).
    """

    # scaler.step(optimizer) calls step(grad_scaler=scaler): sharded_scaling.py
    _step_supports_amp_scaling = True

    def __init__(self, optimizer_class, params, stage=1, bucket_bytes=None, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer: stage must be 1 or 2, got {stage!r}")
        if bucket_bytes is not None and (stage != 2 or not isinstance(bucket_bytes, int)
                                         or bucket_bytes < 1):
            raise ValueError("ShardedOptimizer: bucket_bytes is a whole number of bytes "
                             f">= 1, for stage=2; got {bucket_bytes!r} with stage={stage}")
        groups = as_groups(params)
        self._size, self._rank = basics.size(), basics.rank()
        everything = [p for group in groups for p in group["params"]]
        check_same_everywhere(everything, groups, stage)
        trained = [p for p in everything if p.requires_grad]
        self._index = {p: i for i, p in enumerate(everything)}
        self._stage = stage
        try:     # what one rank refuses (an option, a parameter) fails every rank
            self._shares = (SlicedParameters(trained, self._index, self._size, self._rank,
                                             bucket_bytes or DEFAULT_BUCKET_BYTES)
                            if stage == 2 and self._size > 1 else
                            WholeParameters(trained, self._index, self._size, self._rank))
            self._local, problem = optimizer_class(
                self._shares.local_groups(groups), **defaults), None
        except Exception as error:
            self._local, problem = None, error
        check_same_options(self._local, problem)
        # The global groups take every option the local optimizer filled in.
        super().__init__([{**local, "params": group["params"]}
                          for local, group in zip(self._local.param_groups, groups)],
                         self._local.defaults)
        self.state = self._local.state
        # After consolidate_state_dict: the rank that holds the full state, and
        # there, that state by parameter index.
        self._consolidated_on, self._consolidated = None, None
        self._reduced = False       # clip_grad_norm_ averaged this step's gradients
        self._found_inf = None      # clip_grad_norm_ unscaled them: did a rank find an inf?
        self._built = True

    @property
    def stage(self):
        return self._stage

    @property
    def local_parameters(self):
        """The tensors this rank's optimizer updates: the parameters it owns
        (stage 1), or views of its slices of the parameters (stage 2). Their
        ``.grad`` is the averaged gradient this rank holds, from the end of
        backward (stage 2) or clip_grad_norm_ (both) to the step."""
        return [p for group in self._local.param_groups for p in group["params"]]

    @property
    def exchanged_bytes(self):
        """(bytes this rank gives the gradients' reduce-scatters, bytes it
        gives the parameters' allgathers) in a step, padding included. With
        ring algorithms a rank sends (N-1)/N of the first and N-1 times the
        second (docs/sharded-optimizer.md)."""
        return self._shares.exchanged()

    # -- step ------------------------------------------------------------------

    def step(self, closure=None, grad_scaler=None):
        """Average the gradients, update this rank's share, share it.

        A closure is evaluated once, before the gradients are averaged:
        optimizers that evaluate it several times per step (LBFGS) are not
        supported. ``grad_scaler``: the torch.amp.GradScaler whose step()
        calls this one; the averaged gradients are unscaled, and if any
        rank's held an inf or NaN every rank skips the step and the scaler
        is told, so that its update() lowers the scale.
        """
        if grad_scaler is not None and self._found_inf is None:
            self._check_scaler(grad_scaler)
        for group, local in zip(self.param_groups, self._local.param_groups):
            local.update(options(group))
        self._consolidated_on, self._consolidated = None, None
        if self._reduced:
            if closure is not None:
                raise RuntimeError("ShardedOptimizer.step(closure) after clip_grad_norm_(): "
                                   "the closure would compute gradients that are not "
                                   "averaged; call step() without it")
            loss = None
        else:
            loss = self._shares.reduce(lambda: _loss(closure))
        found, self._reduced, self._found_inf = self._found_inf, False, None
        if grad_scaler is not None and found is None:
            found = unscale_shares(grad_scaler, self, self._held_gradients())
        if found:
            self._shares.forget()       # every rank found it: every rank skips
            return loss
        self._shares.update(self._local.step)
        return loss

    def _held_gradients(self):
        return [p.grad for p in self.local_parameters if p.grad is not None]

    def _check_scaler(self, grad_scaler):
        """Raise, on every rank alike, where scaler.unscale_(optimizer) unscaled
        nothing: stage 2's gradients are not in p.grad."""
        if (isinstance(self._shares, SlicedParameters)
                and unscaled_by_the_scaler(grad_scaler, self)):
            raise RuntimeError(
                "ShardedOptimizer(stage=2): scaler.unscale_(optimizer) unscaled nothing, "
                "since each rank holds slices of the averaged gradients, not p.grad, "
                "and what ran after it saw scaled gradients. To clip, call "
                "optimizer.clip_grad_norm_(max_norm, grad_scaler=scaler) in place of "
                "scaler.unscale_(optimizer) and the clipping; scaler.step(optimizer) "
                "unscales on its own")

    def clip_grad_norm_(self, max_norm, norm_type=2.0, grad_scaler=None):
        """Average this step's gradients now, and scale them so that their
        norm across every rank is at most ``max_norm``; returns that norm
        (before clipping) as torch.nn.utils.clip_grad_norm_ does. Every rank
        calls it, after backward and before step(). With ``grad_scaler``
        (a torch.amp.GradScaler) the gradients are unscaled first, in place
        of scaler.unscale_(optimizer), which in stage 2 cannot reach them."""
        norm_type = float(norm_type)
        unscale = grad_scaler is not None and grad_scaler.is_enabled() and self._found_inf is None
        if unscale:
            self._check_scaler(grad_scaler)
        if not self._reduced:
            self._shares.reduce(lambda: None)
            self._reduced = True
        grads = self._held_gradients()
        if unscale:
            self._found_inf = unscale_shares(grad_scaler, self, grads)
        if norm_type == float("inf"):
            mine = max((g.detach().abs().max().double() for g in grads if g.numel()),
                       default=torch.zeros((), dtype=torch.float64))
        else:
            mine = sum((g.detach().double().norm(norm_type) ** norm_type for g in grads),
                       torch.zeros((), dtype=torch.float64))
        total = synchronize(allreduce_async(
            mine.reshape(1), name="ShardedOptimizer.clip_grad_norm_",
            op=Max if norm_type == float("inf") else Sum))[0]
        if norm_type != float("inf"):
            total = total ** (1.0 / norm_type)
        coefficient = max_norm / (total.item() + 1e-6)
        if coefficient < 1:
            for g in grads:
                g.mul_(coefficient)
        return total.float()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients in ``p.grad`` and send
        nothing, as DDP's no_sync(); the next backward pass (or step())
        sends their sum. Stage 1 sends nothing before step() anyway."""
        if self._stage == 1 or self._size == 1:
            yield
            return
        if not self._shares.sending:
            raise RuntimeError("optimizer.no_sync() blocks cannot be nested")
        self._shares.sending = False
        try:
            yield
        finally:
            self._shares.sending = True

    def zero_grad(self, set_to_none=True):
        """Clear every parameter's gradient, and the gradient slices this rank holds."""
        self._shares.forget()
        self._reduced, self._found_inf = False, None
        super().zero_grad(set_to_none)

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
        shard = np.frombuffer(pickle.dumps(self._shares.shard_state(self._local),
                                           protocol=5), np.uint8)
        splits = np.zeros(self._size, np.int32)
        splits[to] = shard.size
        received, sizes = synchronize(alltoall_async(
            torch.from_numpy(shard.copy()), torch.from_numpy(splits),
            name="ShardedOptimizer.consolidate"))
        state = {}
        if self._rank == to:
            state = self._shares.merge([pickle.loads(piece.numpy().tobytes())
                                        for piece in received.split(sizes.tolist())])
        self._consolidated_on, self._consolidated = to, state

    def state_dict(self):
        """The full state, where consolidate_state_dict gathered it; it does
        not communicate."""
        if self._size == 1:
            return self._full(self._shares.merge([self._shares.shard_state(self._local)]))
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
        return self._full(self._shares.merge(allgather_object(
            self._shares.shard_state(self._local), "ShardedOptimizer.state_dict")))

    def _full(self, state):
        """The state_dict of ``optimizer_class`` with ``state`` by parameter index."""
        return {"state": dict(sorted(state.items())),
                "param_groups": [
                    {**options(group), "params": [self._index[p] for p in group["params"]]}
                    for group in self.param_groups]}

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
        check_shapes(state, parameters)
        self._shares.forget()       # a restore after a failed step: nothing in flight
        self._reduced, self._found_inf = False, None
        positions = iter(range(len(self.local_parameters)))
        self._local.load_state_dict({
            "state": self._shares.local_state(state, self._local),
            "param_groups": [
                {**options(saved), "params": [next(positions) for _ in local["params"]]}
                for saved, local in zip(groups, self._local.param_groups)]})
        for saved, group in zip(groups, self.param_groups):
            group.update(options(saved))
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
