"""DistributedOptimizer(op=Adasum): each rank steps alone, the steps are combined.

As in Horovod, Adasum combines the changes the wrapped optimizer makes, not
the gradients: step() runs the wrapped optimizer on this rank's gradients,
takes each parameter's change (new - old), combines the changes of every
rank with Adasum (mpitrain.transport.adasum), and sets each parameter to
old + the combined change. The optimizer's state (momentum, Adam's moments)
stays each rank's own. Deltas travel in step(), one allreduce per parameter,
which the engine fuses; gradients are never exchanged, so synchronize() has
nothing to do.
"""

import torch

from mpitrain.api.agreement import require_same
from mpitrain.api.handles import synchronize_all
from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Adasum
from mpitrain.torch.compression import Compression, choice
from mpitrain.torch.ops import allreduce_async_
from mpitrain.torch.wrapping import rewrapped


class _AdasumOptimizer:
    """Mixed in before the wrapped optimizer's class; see adasum_optimizer."""

    def _start_adasum(self, names, compression, process_set):
        self._process_set = process_set
        self._names = names
        self._trained = [p for group in self.param_groups for p in group["params"]
                         if p.requires_grad]
        problem = None
        try:
            fused, _ = choice.split(compression, self._trained, self._names)
        except ValueError as error:
            problem = error
        else:
            if fused is not compression:
                problem = ValueError(
                    "op=Adasum combines the parameters' changes in fused allreduces: "
                    "compression must be Compression.none, .fp16 or .bf16, not a "
                    "compressor that moves gradients itself (topk, onebit, int8, int4, "
                    "powersgd) or a choice per parameter")
        if process_set.included():     # a refusal on one rank fails all of them
            require_same("DistributedOptimizer(op=Adasum)",
                         {"compression": getattr(compression, "__name__", compression)},
                         "DistributedOptimizer.adasum", process_set, problem)
        elif problem:
            raise problem
        self._compression = compression

    def synchronize(self):
        """Nothing to wait for: the parameters' changes travel in step()."""

    def skip_synchronize(self):
        raise AssertionError("skip_synchronize() does not apply with op=Adasum: "
                             "step() exchanges the parameters' changes, not the "
                             "gradients (as in Horovod)")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        else:
            loss = None
        if not self._process_set.included():
            super().step()
            return loss
        starts = [p.detach().clone() for p in self._trained]
        super().step()
        handles, contexts, errors = [], [], []
        for p, start in zip(self._trained, starts):
            delta = p.detach()
            delta.sub_(start)                     # the parameter holds its change
            try:
                wire, context = self._compression.compress(delta)
                handles.append(allreduce_async_(wire, None, self._names[p], Adasum,
                                                process_set=self._process_set))
                contexts.append(context)
            except Exception as error:   # submit the rest, so that no peer waits for them
                errors.append(error)
        results, failed = synchronize_all(handles)
        errors += failed
        if errors:
            for p, start in zip(self._trained, starts):   # no step rather than half of one
                p.copy_(start)
            raise errors[0]
        for p, start, result, context in zip(self._trained, starts, results, contexts):
            start.add_(self._compression.decompress(result, context))
            p.copy_(start)
        return loss

    def add_param_group(self, param_group):
        raise ValueError(
            "add_param_group() on a DistributedOptimizer would leave the new "
            "parameters out of the exchange: add the group to the optimizer "
            "before wrapping it")


# As for _DistributedOptimizer: stops torch from running step hooks twice.
_AdasumOptimizer.step.hooked = True


def adasum_optimizer(optimizer, names, compression=Compression.none,
                     process_set=global_process_set):
    """``optimizer`` wrapped to combine its steps across ranks with Adasum;
    ``names``: each parameter's (parameter_names).

    Called by DistributedOptimizer(op=Adasum), which has checked the options
    that apply; the others do not: gradients accumulate locally in p.grad
    until step() whatever backward_passes_per_step says, the engine fuses the
    deltas without groups, and the deltas are dense.
    """
    if isinstance(optimizer, _AdasumOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    distributed = rewrapped(optimizer, _AdasumOptimizer)
    distributed._start_adasum(names, compression, process_set)
    return distributed
