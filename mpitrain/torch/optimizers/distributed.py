"""DistributedOptimizer: gradients averaged across ranks while backward runs.

Each parameter's gradient is submitted from a post-accumulate-grad hook as
soon as autograd has produced it, so communication overlaps the rest of the
backward pass; the reduction writes into ``p.grad`` in place. ``step()``
waits for every submission, then steps the wrapped optimizer. From the
second step on, small gradients live in flat buckets
(mpitrain.torch.optimizers.buckets), each reduced as one tensor once its last
gradient has arrived.
"""

import contextlib
import os
import warnings
import weakref

import torch

from mpitrain.api import engine_sizes
from mpitrain.api.handles import synchronize_all
from mpitrain.api.objects import broadcast_object
from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Adasum, Average, Sum, resolve_op
from mpitrain.torch.optimizers import buckets
from mpitrain.torch.compression import Compression, choice
from mpitrain.torch.ops import (allreduce_async_, grouped_allreduce_async_,
                                sparse_allreduce_async)
from mpitrain.torch.wrapping import rewrapped


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's class; see DistributedOptimizer."""

    def _start_distributing(self, named_parameters, compression,
                            backward_passes_per_step, op, gradient_predivide_factor,
                            groups, sparse_as_dense, process_set, overlap):
        self._passes_per_step = backward_passes_per_step
        self._op = op
        if op == Average:
            # The core divides by the set's size after the sum.
            self._scale = (1.0 / gradient_predivide_factor, gradient_predivide_factor)
        else:
            self._scale = (1.0, 1.0)
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._names = _parameter_names(self.param_groups, named_parameters)
        self._trained = [p for group in self.param_groups for p in group["params"]
                         if p.requires_grad]
        # Parameters whose compressor moves them itself travel alone.
        self._compression, self._compressor_of = choice.agreed_split(
            compression, self._trained, self._names, process_set)
        if self._compressor_of and op not in (Average, Sum):
            raise ValueError("compressors such as Compression.topk sum what they "
                             f"receive: op must be Average or Sum, got {op.name}")
        # Alone in its set, a rank has nothing to exchange: the average of one
        # gradient is that gradient, so step() costs what the plain one does
        # (unless a test asks for the whole pipeline on one rank).
        self._alone = (process_set.included() and process_set.size() == 1
                       and not engine_sizes.one_rank_moves_data())
        self._overlap = not self._alone and (
            _communication_can_overlap(self._trained) if overlap is None
            else bool(overlap))
        self._passes_left = {p: backward_passes_per_step for p in self._trained}
        # A parameter in a group (a tuple) or a bucket travels with the others
        # in it once their gradients have all arrived; the rest travel alone.
        self._unit_of = _form_groups(
            [p for p in self._trained if p not in self._compressor_of], groups,
            self._names, process_set)
        self._arrived = dict.fromkeys(set(self._unit_of.values()), 0)
        self._buckets = None        # formed after the first synchronize
        self._pending = {}          # parameter, group or bucket -> (handle, write back)
        self._synchronized = False
        self._should_synchronize = True
        self._sending = True        # False inside no_sync(): backward sends nothing
        if process_set.included():
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
        if _gradient_of(p).is_sparse and not self._sparse_as_dense:
            handle = sparse_allreduce_async(p.grad, self._names[p], self._op,
                                            self._process_set)
            return handle, lambda result: setattr(p, "grad", result)
        tensor, ctx = self._wire_form(p)
        handle = allreduce_async_(tensor, None, self._names[p], self._op, *self._scale,
                                  self._process_set)
        return handle, lambda result: self._write_back(p, result, ctx)

    def _submit_compressed(self, p):
        """p.grad through its compressor's own exchange (summed, then averaged here)."""
        grad = _gradient_of(p)
        exchange = self._compressor_of[p].start(grad.to_dense() if grad.is_sparse else grad,
                                                self._names[p], self._process_set)
        divisor = self._process_set.size() if self._op == Average else 1

        def write_back(total):
            self._write_back(p, total.div_(divisor) if divisor != 1 else total, None)

        return exchange, write_back

    def _submit_group(self, group):
        for p in group:
            if _gradient_of(p).is_sparse and not self._sparse_as_dense:
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
        grad = _gradient_of(p)
        return self._compression.compress(grad.to_dense() if grad.is_sparse else grad)

    def _write_back(self, p, result, ctx):
        result = self._compression.decompress(result, ctx)
        if p.grad.is_sparse:
            p.grad = result.to_sparse()
        elif result is not p.grad:
            p.grad.copy_(result)

    # -- the optimizer's interface --------------------------------------------

    def synchronize(self):
        """Wait until every gradient is averaged across ranks.

        Parameters that got no gradient on this rank contribute zeros, so
        ranks whose graphs differ do not wait for each other forever.
        """
        if not self._process_set.included():
            self._synchronized = True
            return
        if self._alone:
            for p in self._trained:
                _gradient_of(p)        # zeros where backward gave none, as with peers
            self._start_over()
            self._synchronized = True
            return
        errors = self._submit_the_rest() + self._wait_for_pending()
        self._start_over()
        if errors:
            raise errors[0]
        if self._buckets is None:
            self._form_buckets()
        self._synchronized = True

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

    def drop_step(self):
        """Throw this step's gradients away and start the next step clean.

        For a backward pass that raised (a bad batch, out of memory) and was
        caught. The gradients this rank has not sent yet go out as they are,
        so no other rank waits for them; every reduction is waited for and
        discarded, and every ``p.grad`` becomes None. Ranks that step instead
        average with what this rank sent: to skip the batch everywhere, agree
        first (an allreduce of a "failed" flag with op=Max) and call this on
        every rank.
        """
        errors = []
        if self._process_set.included() and not self._alone:
            errors = self._submit_the_rest() + self._wait_for_pending()
        self._start_over()
        super().zero_grad(set_to_none=True)
        if errors:
            raise errors[0]

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

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Let step() use gradients already synchronized by synchronize()."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally and send nothing.

        As DDP's ``no_sync()``: the first backward pass after the block sends
        the sum of every pass's gradients, and ``step()`` applies their
        average across ranks. Ranks may run different numbers of passes
        inside; those passes do not count toward backward_passes_per_step.
        """
        if not self._sending:
            raise RuntimeError("optimizer.no_sync() blocks cannot be nested")
        self._sending = False
        try:
            yield
        finally:
            self._sending = True

    def step(self, closure=None):
        if not self._sending:
            raise RuntimeError(
                "optimizer.step() inside optimizer.no_sync(): the gradients "
                "accumulated there have not been sent to the other ranks; run one "
                "more backward pass after the block, then step()")
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() "
                    "context after optimizer.synchronize(). This can cause training "
                    "slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step() if closure is None else super().step(closure)

    def zero_grad(self, set_to_none=True):
        if self._pending or any(left != self._passes_per_step
                                for left in self._passes_left.values()):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): gradients are still "
                "being reduced into p.grad. Call zero_grad() before backward, or "
                "after step(); to skip a step whose backward failed, call "
                "optimizer.drop_step().")
        return super().zero_grad(set_to_none)

    def state_dict(self):
        """The wrapped optimizer's, and the compressors' (residuals, PowerSGD's Q)."""
        state = super().state_dict()
        compression = choice.state(self._compressor_of, self._names,
                                   self._process_set.rank())
        if compression is not None:
            state["compression"] = compression
        return state

    def load_state_dict(self, state_dict):
        """Residuals come back only on the rank that saved them (see
        docs/compression.md); the rest of the state on every rank."""
        compression = state_dict.get("compression")
        super().load_state_dict({key: value for key, value in state_dict.items()
                                 if key != "compression"})
        if compression is not None:
            choice.load(self._compressor_of, self._names, compression,
                        self._process_set.rank())

    def add_param_group(self, param_group):
        raise ValueError(
            "add_param_group() on a DistributedOptimizer would leave the new "
            "parameters' gradients unsynchronized: add the group to the optimizer "
            "before wrapping it")


# step() calls the wrapped class's step, which torch has already wrapped to run
# step hooks; this stops torch from wrapping ours too and running them twice.
_DistributedOptimizer.step.hooked = True


def _gradient_of(p):
    if p.grad is None:
        # Another rank may have a gradient for p: contribute zeros.
        p.grad = torch.zeros_like(p)
    return p.grad


def _remove_all(handles):
    for handle in handles:
        handle.remove()


def _parameter_names(param_groups, named_parameters):
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


def _form_groups(trained, groups, names, process_set):
    """Map each grouped parameter to its group (a tuple reduced in one call)."""
    if groups is None:
        return {}
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
        trained_set = set(trained)
        formed = [tuple(p for p in group if p in trained_set) for group in groups]
    else:
        if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
            raise ValueError("groups must be a positive number of groups or a list "
                             f"of lists of parameters, got {groups!r}")
        # Every rank must form the same groups: follow rank 0's parameter order.
        order = broadcast_object([names[p] for p in trained], process_set.ranks[0],
                                 "DistributedOptimizer.parameter_order", process_set)
        by_name = {names[p]: p for p in trained}
        ordered = [by_name.pop(name) for name in order if name in by_name]
        if by_name:
            raise ValueError(
                f"rank {process_set.ranks[process_set.rank()]} has parameters that rank "
                f"{process_set.ranks[0]} lacks: "
                f"{', '.join(sorted(by_name))}; every rank must build the same model")
        size, extra = divmod(len(ordered), groups)
        formed, start = [], 0
        for index in range(groups):
            end = start + size + (1 if index < extra else 0)
            formed.append(tuple(ordered[start:end]))
            start = end
    return {p: group for group in formed if group for p in group}


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


def DistributedOptimizer(optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False,
                         process_set=global_process_set, overlap=None):
    """Wrap ``optimizer`` so that step() uses gradients averaged across ranks.

    The result is an instance of the wrapped optimizer's class and shares its
    state and parameter groups; use it in place of the original.

    named_parameters: (name, parameter) pairs naming every parameter; the
        names match gradients across ranks (by position otherwise).
    compression: Compression.none, .fp16 or .bf16 (a cast for the wire), or
        Compression.topk, .onebit, .int8, .int4 or .powersgd (which leave
        parameters of one dimension or few elements uncompressed), or a
        choice per parameter: a dict of names, or a function of (name,
        parameter), giving one of the latter or None. See docs/compression.md.
    backward_passes_per_step: backward passes accumulated locally before
        the gradients are reduced.
    op: Average (default) or Sum; gradient_predivide_factor f divides
        before the sum and multiplies by f/size after (Average only).
        op=Adasum combines each rank's parameter changes instead
        (mpitrain.torch.optimizers.adasum, docs/adasum.md).
    groups: a number of groups, or lists of parameters; each group is reduced
        in one grouped call once all its gradients are ready. num_groups is
        the deprecated form.
    sparse_as_dense: reduce sparse gradients as dense tensors; otherwise their
        indices and values are gathered from every rank.
    process_set: the ranks that average their gradients.
    overlap: reduce each gradient as soon as backward produces it (True), or
        all of them in step() (False). None chooses: overlap where the
        gradients are on a GPU or the process has a core more than torch's
        threads, since on a shared core overlapping is slower.
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    op = resolve_op(op, None)
    if op == Adasum:
        from mpitrain.torch.optimizers.adasum import adasum_optimizer  # it imports this
        return adasum_optimizer(optimizer, named_parameters, compression,
                                gradient_predivide_factor, process_set)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is supported only with op=Average")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be a whole number >= 1, got "
                         f"{backward_passes_per_step!r}")
    if num_groups:
        warnings.warn("num_groups is deprecated; pass groups=", DeprecationWarning,
                      stacklevel=2)
        if groups is None:
            groups = num_groups
    distributed = rewrapped(optimizer, _DistributedOptimizer)
    distributed._start_distributing(named_parameters, compression,
                                    backward_passes_per_step, op,
                                    gradient_predivide_factor, groups,
                                    sparse_as_dense, process_set, overlap)
    return distributed
