"""ShardedOptimizer and torch.amp.GradScaler: the optimizer unscales what it holds.

A GradScaler unscales and checks for inf and NaN the ``p.grad`` of the
optimizer's param_groups. A ShardedOptimizer's averaged gradients are not
there: in stage 2 ``p.grad`` is None after backward (the rank holds slices),
in stage 1 it is the rank's own gradient until step() averages it. The
scaler would find nothing (stage 2: "No inf checks were recorded"), or an
overflow on one rank only, which would skip the step there while the others
wait in the parameters' allgather. So ShardedOptimizer takes over loss
scaling the way torch lets an optimizer do it: with
``_step_supports_amp_scaling`` set and a ``grad_scaler`` argument to step(),
scaler.step(optimizer) hands the scaler to step(), which unscales the
averaged shares itself, asks every rank whether one found an inf or NaN
(a Max allreduce, so every rank skips or steps alike) and records the
answer where the scaler's update() reads it, so the scale drops as usual.
"""

from collections import defaultdict

import torch
from torch.amp.grad_scaler import OptState

from mpitrain.api.handles import synchronize
from mpitrain.ops import Max
from mpitrain.torch.ops import allreduce_async


def unscaled_by_the_scaler(grad_scaler, optimizer):
    """Has ``scaler.unscale_(optimizer)`` run since the last update()?"""
    return grad_scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


def unscale_shares(grad_scaler, optimizer, gradients):
    """Divide ``gradients`` (the averaged ones this rank holds) by the
    scaler's scale, unless scaler.unscale_(optimizer) already did (stage 1's
    p.grad), and record in the scaler whether any rank's held an inf or NaN;
    returns that answer, the same on every rank. Every rank calls it."""
    state = grad_scaler._per_optimizer_states[id(optimizer)]
    multiplier = 1.0 if state["stage"] is OptState.UNSCALED else 1.0 / grad_scaler.get_scale()
    found = found_inf(gradients, multiplier)
    record(grad_scaler, optimizer, found)
    state["stage"] = OptState.UNSCALED
    return found


def found_inf(gradients, multiplier=1.0):
    """Multiply ``gradients`` by ``multiplier`` in place; True on every rank
    if any rank's held an inf or NaN."""
    by_kind = defaultdict(list)
    for grad in gradients:
        by_kind[grad.device, grad.dtype].append(grad)
    found = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        for (device, _), grads in by_kind.items():
            here = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, here, torch.full((), multiplier, dtype=torch.float32, device=device))
            found += here.cpu()
    return bool(synchronize(allreduce_async(found, name="ShardedOptimizer.found_inf",
                                            op=Max))[0] > 0)


def record(grad_scaler, optimizer, found):
    """Leave ``found`` where the scaler's update() looks for this optimizer's
    inf checks, in place of the scaler's own (one rank's, or none)."""
    checks = grad_scaler._found_inf_per_device(optimizer)
    checks.clear()
    checks[torch.device("cpu")] = torch.tensor(float(found))
