"""The reducer of DistributedOptimizer: gradient hooks, buckets, write-backs.

PyTorch keeps DDP's Reducer (hooks, buckets, the state of one backward pass)
apart from DistributedDataParallel, the object users call; this module is
that half of DistributedOptimizer, mixed into _DistributedOptimizer
(distributed.py), which calls it. Each parameter's gradient is submitted
from a post-accumulate-grad hook as soon as autograd has produced it, so
communication overlaps the rest of the backward pass; the reduction writes
into ``p.grad`` in place. From the second step on, small gradients live in
flat buckets (buckets.py), each reduced as one tensor once its last gradient
has arrived.
"""

import os
import weakref

import torch

from mpitrain.api import engine_sizes
from mpitrain.api.handles import synchronize_all
from mpitrain.api.objects import broadcast_object
from mpitrain.ops import Average
from mpitrain.torch.ops import (allreduce_async_, grouped_allreduce_async_,
                                sparse_allreduce_async)
from mpitrain.torch.optimizers import buckets
from mpitrain.torch.optimizers.parameter_names import form_groups


class Reducer:
    """The state of one step's gradients, from the hooks to ``p.grad``.

    Mixed into _DistributedOptimizer, whose _start_distributing sets what
    the reducer reads (``_process_set``, ``_names``, ``_trained``,
    ``_compression``, ``_compressor_of``, ``_alone``) before it calls
    _start_reducing.
    """

    def _start_reducing(self, op, gradient_predivide_factor, sparse_as_dense,
                        backward_passes_per_step, groups, overlap):
        self._passes_per_step = backward_passes_per_step
        self._op = op
        if op == Average:
            # The core divides by the set's size after the sum.
            self._scale = (1.0 / gradient_predivide_factor, gradient_predivide_factor)
        else:
            self._scale = (1.0, 1.0)
        self._sparse_as_dense = sparse_as_dense
        self._overlap = not self._alone and (
            _communication_can_overlap(self._trained) if overlap is None
            else bool(overlap))
        self._passes_left = {p: backward_passes_per_step for p in self._trained}
        # A parameter in a group (a tuple) or a bucket travels with the others
        # in it once their gradients have all arrived; the rest travel alone.
        self._unit_of = form_groups(
            [p for p in self._trained if p not in self._compressor_of], groups,
            self._names, self._process_set)
        self._arrived = dict.fromkeys(set(self._unit_of.values()), 0)
        self._buckets = None        # formed after the first synchronize
        self._pending = {}          # parameter, group or bucket -> (handle, write back)
        self._synchronized = False
        self._sending = True        # False inside no_sync(): backward sends nothing
        if self._process_set.included():
            self._register_hooks()

    def _register_hooks(self):
        this = weakref.ref(self)

        def on_gradient(p):
            optimizer = this()
            if optimizer is not None:
                optimizer._gradient_ready(p)

        handles = [p.register_post_accumulate_grad_hook(on_gradient)
                   for p in self._trained]
        # Hooks live on the parameters: remove them when this optimizer goes.
        weakref.finalize(self, _remove_all, handles)

    def _gradient_ready(self, p):
        if not self._sending:
            return                      # accumulated in p.grad by autograd, counted later
        if self._passes_left[p] == 0:
            raise AssertionError(
                f"the gradient of '{self._names[p]}' was computed more than "
                f"backward_passes_per_step={self._passes_per_step} times before "
                "step(). Increase backward_passes_per_step to accumulate gradients "
                "locally.")
        self._passes_left[p] -= 1
        unit = self._unit_of.get(p)
        if isinstance(unit, buckets.Bucket):
            unit.take(p)                # into its view while the gradient is in cache
        if self._passes_left[p] > 0 or not self._overlap:
            return                      # without overlap, step() submits them all
        try:
            if unit is None:
                self._pending[p] = self._submit(p)
                return
            self._arrived[unit] += 1
            if self._arrived[unit] == len(unit):
                self._pending[unit] = self._submit_unit(unit)
        except Exception:
            # Backward ends here: without this, the gradients submitted before
            # would stay counted as in flight and zero_grad() would refuse forever.
            self._wait_for_pending()
            self._start_over()
            raise

    # -- submissions -----------------------------------------------------------

    def _submit_unit(self, unit):
        if isinstance(unit, buckets.Bucket):
            return self._submit_bucket(unit)
        return self._submit_group(unit) if isinstance(unit, tuple) else self._submit(unit)

    def _submit(self, p):
        """Start reducing p.grad; returns (handle, write back of the result)."""
        if p in self._compressor_of:
            return self._submit_compressed(p)
        if gradient_of(p).is_sparse and not self._sparse_as_dense:
            handle = sparse_allreduce_async(p.grad, self._names[p], self._op,
                                            self._process_set)
            return handle, lambda result: setattr(p, "grad", result)
        tensor, ctx = self._wire_form(p)
        handle = allreduce_async_(tensor, None, self._names[p], self._op, *self._scale,
                                  self._process_set)
        return handle, lambda result: self._write_back(p, result, ctx)

    def _submit_compressed(self, p):
        """p.grad through its compressor's own exchange (summed, then averaged here)."""
        grad = gradient_of(p)
        exchange = self._compressor_of[p].start(grad.to_dense() if grad.is_sparse else grad,
                                                self._names[p], self._process_set)
        divisor = self._process_set.size() if self._op == Average else 1

        def write_back(total):
            self._write_back(p, total.div_(divisor) if divisor != 1 else total, None)

        return exchange, write_back

    def _submit_group(self, group):
        for p in group:
            if gradient_of(p).is_sparse and not self._sparse_as_dense:
                raise ValueError(
                    f"'{self._names[p]}' has a sparse gradient, which a group cannot "
                    "hold: pass sparse_as_dense=True, or leave the parameter out of "
                    "groups")
        tensors, contexts = zip(*[self._wire_form(p) for p in group])
        handle = grouped_allreduce_async_(tensors, None, self._names[group[0]],
                                          self._op, *self._scale, self._process_set)

        def write_back(results):
            for p, result, ctx in zip(group, results, contexts):
                self._write_back(p, result, ctx)

        return handle, write_back

    def _submit_bucket(self, bucket):
        """One in-place allreduce of the flat bucket (compressed once)."""
        tensor, ctx = self._compression.compress(bucket.gather())
        handle = allreduce_async_(tensor, None, bucket.name, self._op, *self._scale,
                                  self._process_set)

        def write_back(result):
            result = self._compression.decompress(result, ctx)
            if result is not bucket.flat:
                bucket.flat.copy_(result)
            bucket.point()

        return handle, write_back

    def _wire_form(self, p):
        """p.grad as it travels in an allreduce (dense, compressed), and its context."""
        grad = gradient_of(p)
        return self._compression.compress(grad.to_dense() if grad.is_sparse else grad)

    def _write_back(self, p, result, ctx):
        result = self._compression.decompress(result, ctx)
        if p.grad.is_sparse:
            p.grad = result.to_sparse()
        elif result is not p.grad:
            p.grad.copy_(result)

    # -- what synchronize() and drop_step() call ---------------------------------

    def _form_buckets(self):
        """Put the small dense gradients into buckets, the same on every rank.

        After the first synchronize: its allreduces have checked the shapes
        across ranks, and every p.grad is set, so sparse ones show. Sparse
        gradients stay out even with sparse_as_dense, which gives them back
        sparse. Rank 0's plan is followed.
        """
        candidates = [p for p in self._trained if p not in self._unit_of
                      and p not in self._compressor_of
                      and not p.grad.is_sparse and buckets.small(p)]
        threshold = engine_sizes.fusion_threshold()
        plan = broadcast_object(
            buckets.plan(candidates, self._names, threshold or buckets.DEFAULT_CAP)
            if self._process_set.rank() == 0 else None,
            self._process_set.ranks[0], "DistributedOptimizer.buckets", self._process_set)
        ungrouped = {self._names[p]: p for p in self._trained if p not in self._unit_of}
        self._buckets = buckets.form(plan, ungrouped, self._process_set.rank())
        for bucket in self._buckets:
            bucket.gather()             # p.grad becomes its view, holding its value
            self._unit_of.update(dict.fromkeys(bucket.params, bucket))
            self._arrived[bucket] = 0

    def _submit_the_rest(self):
        """Submit every gradient not yet in flight; returns the errors."""
        errors = []
        for p in self._trained:
            unit = self._unit_of.get(p, p)
            if unit not in self._pending:
                try:
                    self._pending[unit] = self._submit_unit(unit)
                except Exception as error:  # submit the rest, so no peer waits for them
                    errors.append(error)
        return errors

    def _wait_for_pending(self):
        """Wait for every submitted reduction, write back its result; returns the errors."""
        pending = list(self._pending.values())
        results, errors = synchronize_all([handle for handle, _ in pending])
        for (_, write_back), result in zip(pending, results):
            if result is not None:
                write_back(result)
        return errors

    def _start_over(self):
        """Forget this step's gradients: none is counted as arrived or in flight."""
        self._pending.clear()
        self._passes_left = dict.fromkeys(self._trained, self._passes_per_step)
        self._arrived = dict.fromkeys(self._arrived, 0)
        self._synchronized = False


def gradient_of(p):
    """``p.grad``, made zeros where backward gave p none."""
    if p.grad is None:
        # Another rank may have a gradient for p: contribute zeros.
        p.grad = torch.zeros_like(p)
    return p.grad


def _remove_all(handles):
    for handle in handles:
        handle.remove()


def _communication_can_overlap(parameters):
    """Does reducing gradients during backward pay here?

    Only when the engine's MPI work does not take the training thread's
    core: with gradients on a GPU, or with more cores for this process than
    torch computes with. Otherwise (one core per rank) the two slow each
    other down, and reducing everything in step() is faster (measured with
    benchmarks/train_step.py on 2 ranks with a core each: 128-135 ms against
    141-147 ms per step).
    """
    if any(p.device.type != "cpu" for p in parameters):
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:          # no affinity query on this system
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()
