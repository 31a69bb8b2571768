"""Local SGD: ranks step on their own and average their parameters every K steps.

PyTorch's post-local-SGD (``PostLocalSGDOptimizer`` with a
``PeriodicModelAverager``) on mpitrain: ``warmup_steps`` fully synchronous
steps (gradients averaged, as DistributedOptimizer does), then each rank
steps on its own gradients and every ``period`` steps the parameters (and,
optionally, the optimizer state) are averaged in one grouped allreduce.

With ``overlap_averaging`` the average of the parameters as they were after
step K travels while step K+1 computes its forward and backward pass; before
step K+1 changes them, each rank moves its parameters by
``average - snapshot``, so the local progress made since the snapshot is
kept on top of the average. The price is one step of staleness: step K+1's
gradient was computed at this rank's parameters, not at the average.
"""

import contextlib

import torch

from mpitrain.api.agreement import require_same
from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Adasum, Average, resolve_op
from mpitrain.torch.ops import grouped_allreduce_async_
from mpitrain.torch.optimizers.distributed import (DistributedOptimizer,
                                                   _DistributedOptimizer)
from mpitrain.torch.wrapping import mixed_in

AVERAGE_NAME = "LocalSGDOptimizer.average"
SETTINGS_NAME = "LocalSGDOptimizer.settings"


class _LocalSGD(_DistributedOptimizer):
    """Mixed in before a DistributedOptimizer's class; see LocalSGDOptimizer."""

    def _start_local_sgd(self, period, warmup_steps, average_optimizer_state,
                         overlap_averaging):
        self._period = period
        self._warmup_left = warmup_steps
        self._local_steps = 0
        self._average_state = average_optimizer_state
        self._overlap_averaging = overlap_averaging
        self._averaging = None      # (handle, tensors, snapshot, averaged) in flight
        self._averages = (not self._alone and self._process_set.included())
        if warmup_steps == 0:
            self._sending = False

    @property
    def local_phase(self):
        """True once the warm-up is over and ranks step on their own gradients."""
        return self._warmup_left == 0

    def step(self, closure=None):
        if not self.local_phase:
            result = _DistributedOptimizer.step(self, closure)
            self._warmup_left -= 1
            if self.local_phase:
                self._sending = False       # from now on backward sends nothing
            return result
        self._finish_averaging()            # before this step changes the parameters
        result = super(_DistributedOptimizer, self).step(closure)
        self._local_steps += 1
        if self._local_steps % self._period == 0 and self._averages:
            self._start_averaging()
            if not self._overlap_averaging:
                self._finish_averaging()
        return result

    def average_parameters(self):
        """Average the parameters (and optimizer state, if chosen) now.

        Every rank of the set calls it, for instance before evaluating or
        saving: the ranks hold identical parameters afterwards. An average
        still in flight is applied first.
        """
        if not self._averages:
            return
        self._finish_averaging()
        self._start_averaging()
        self._finish_averaging()

    def _averaged_tensors(self):
        """The tensors every rank averages, in the same order on every rank."""
        tensors = [p for group in self.param_groups for p in group["params"]]
        if self._average_state:
            for p in list(tensors):
                state = self.state.get(p, {})
                tensors += [state[key] for key in sorted(state) if key != "step"
                            and isinstance(state[key], torch.Tensor)
                            and state[key].is_floating_point()]
        return tensors

    def _start_averaging(self):
        tensors = self._averaged_tensors()
        snapshot = [t.detach().clone() for t in tensors]
        averaged = [t.clone() for t in snapshot]
        handle = grouped_allreduce_async_(averaged, name=AVERAGE_NAME, op=Average,
                                          process_set=self._process_set)
        self._averaging = (handle, tensors, snapshot, averaged)

    def _finish_averaging(self):
        """Wait for the average in flight and move every tensor by
        ``average - snapshot`` (exactly the average where it has not changed)."""
        if self._averaging is None:
            return
        handle, tensors, snapshot, averaged = self._averaging
        self._averaging = None
        handle.wait()
        with torch.no_grad():
            local = [t.detach() for t in tensors]
            torch._foreach_sub_(local, snapshot)
            torch._foreach_add_(local, averaged)

    def synchronize(self):
        """In the local phase gradients stay on their rank: nothing to wait for."""
        if self.local_phase:
            self._synchronized = True
            return
        _DistributedOptimizer.synchronize(self)

    def no_sync(self):
        if self.local_phase:
            return contextlib.nullcontext()
        return _DistributedOptimizer.no_sync(self)

    def drop_step(self):
        if self.local_phase:
            super(_DistributedOptimizer, self).zero_grad(set_to_none=True)
            return
        _DistributedOptimizer.drop_step(self)


_LocalSGD.step.hooked = True         # see _DistributedOptimizer.step


def LocalSGDOptimizer(optimizer, named_parameters=None, period=4, warmup_steps=0,
                      average_optimizer_state=False, overlap_averaging=True,
                      process_set=global_process_set, **options):
    """Wrap ``optimizer`` for local SGD: ``warmup_steps`` synchronous steps, then
    local steps with the parameters averaged across ranks every ``period`` steps.

    The result is an instance of the wrapped optimizer's class, like
    DistributedOptimizer's, and takes the same ``options`` (compression,
    groups, ...) for the warm-up's gradient averaging.

    period: local steps between two averages of the parameters (1: every step).
    warmup_steps: steps at the start that average gradients, as
        DistributedOptimizer does, before the local steps begin.
    average_optimizer_state: also average the optimizer's floating-point
        state (momentum buffers, Adam's moments) with the parameters.
    overlap_averaging: let the average travel during the next step's forward
        and backward pass, applied as ``average - snapshot`` before that step
        (one step stale); False waits for it in the step that starts it.
    process_set: the ranks that average.

    Call ``average_parameters()`` on every rank before evaluating or saving
    to make the ranks' parameters identical. Every rank of the set builds it
    with the same period, warmup_steps, average_optimizer_state and
    overlap_averaging; otherwise each raises a MismatchError naming them.
    """
    problem = None
    try:
        _check_arguments(period, warmup_steps, options)
    except ValueError as error:
        problem = error
    if process_set.included():
        # Ranks that average at different steps pair averages of different
        # steps, and the last one waits forever: every rank must agree.
        require_same("LocalSGDOptimizer", {
            "period": period, "warmup_steps": warmup_steps,
            "average_optimizer_state": average_optimizer_state,
            "overlap_averaging": overlap_averaging}, SETTINGS_NAME, process_set, problem)
    elif problem:
        raise problem
    distributed = DistributedOptimizer(optimizer, named_parameters,
                                       process_set=process_set, **options)
    distributed.__class__ = mixed_in(_LocalSGD, type(distributed))
    distributed._start_local_sgd(period, warmup_steps, average_optimizer_state,
                                 overlap_averaging)
    return distributed


def _check_arguments(period, warmup_steps, options):
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be a whole number >= 1, got {period!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) \
            or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a whole number >= 0, got {warmup_steps!r}")
    if resolve_op(options.get("op", Average), None) == Adasum:
        raise ValueError("LocalSGDOptimizer averages parameters and cannot take "
                         "op=Adasum; use DistributedOptimizer(op=Adasum) instead")
