"""DistributedOptimizer: gradients averaged across ranks while backward runs.

The facade users call, as DistributedDataParallel is in PyTorch: it checks
the arguments, builds the optimizer (an instance of the wrapped optimizer's
class) and gives it the optimizer's interface. ``step()`` waits for every
gradient's reduction, then steps the wrapped optimizer. The reduction
itself, from the gradient hooks to the write-back into ``p.grad``, is the
Reducer's (reducer.py).
"""

import contextlib
import warnings

from mpitrain.api import engine_sizes
from mpitrain.api.agreement import require_same
from mpitrain.api.process_sets import global_process_set
from mpitrain.ops import Adasum, Average, Sum, resolve_op
from mpitrain.torch.compression import Compression, choice
from mpitrain.torch.optimizers.adasum import adasum_optimizer
from mpitrain.torch.optimizers.parameter_names import groups_setting, parameter_names
from mpitrain.torch.optimizers.reducer import Reducer, gradient_of
from mpitrain.torch.wrapping import rewrapped


class _DistributedOptimizer(Reducer):
    """Mixed in before the wrapped optimizer's class; see DistributedOptimizer."""

    def _start_distributing(self, names, compression,
                            backward_passes_per_step, op, gradient_predivide_factor,
                            groups, sparse_as_dense, process_set, overlap):
        self._process_set = process_set
        self._names = names
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
        self._should_synchronize = True
        self._start_reducing(op, gradient_predivide_factor, sparse_as_dense,
                             backward_passes_per_step, groups, overlap)

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
                gradient_of(p)         # zeros where backward gave none, as with peers
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

    Every rank of the set freezes the same parameters and passes the same
    op, gradient_predivide_factor, groups, sparse_as_dense and compression;
    otherwise each raises a MismatchError naming them.
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    if num_groups:
        warnings.warn("num_groups is deprecated; pass groups=", DeprecationWarning,
                      stacklevel=2)
        if groups is None:
            groups = num_groups
    names, op = _agreed_options(optimizer.param_groups, named_parameters, op,
                                gradient_predivide_factor, backward_passes_per_step,
                                groups, sparse_as_dense, process_set)
    if op == Adasum:
        return adasum_optimizer(optimizer, names, compression, process_set)
    distributed = rewrapped(optimizer, _DistributedOptimizer)
    distributed._start_distributing(names, compression,
                                    backward_passes_per_step, op,
                                    gradient_predivide_factor, groups,
                                    sparse_as_dense, process_set, overlap)
    return distributed


def _agreed_options(param_groups, named_parameters, op, gradient_predivide_factor,
                    backward_passes_per_step, groups, sparse_as_dense, process_set):
    """(the parameters' names, the op), once every rank of ``process_set``
    passed options that agree (see _settings).

    Otherwise a MismatchError on every rank naming the first that differs,
    or, where a rank refused its own options, that error there and one
    naming that rank on the others: ranks built otherwise take other paths
    through a step (Adasum's exchange in step(), grouped calls, sparse
    gathers) and waited for each other until the stall shutdown.
    """
    names, settings, labels, problem = {}, {}, {}, None
    try:
        names = parameter_names(param_groups, named_parameters)
        op = resolve_op(op, None)
        settings, labels = _settings(param_groups, names, op, gradient_predivide_factor,
                                     backward_passes_per_step, groups, sparse_as_dense)
    except (TypeError, ValueError) as error:
        problem = error
    if process_set.included():
        require_same("DistributedOptimizer", settings, "DistributedOptimizer.options",
                     process_set, problem, labels, absent="no")
    elif problem:
        raise problem
    return names, op


def _settings(param_groups, names, op, gradient_predivide_factor,
              backward_passes_per_step, groups, sparse_as_dense):
    """({key: what every rank must pass}, {key: how a message names it});
    ValueError for an option refused on its own.

    backward_passes_per_step and overlap may differ: step() sends every
    gradient the hooks have not sent, so every rank sends each gradient
    once a step whatever they say (a rank that accumulates more passes
    sends their sum, as after no_sync()). The compressors are compared
    next, per trained parameter (choice.agreed_split); buckets follow rank
    0's plan; the process set is where the comparison runs.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is supported only with op=Average, "
                         f"not op={op.name.capitalize()}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be a whole number >= 1, got "
                         f"{backward_passes_per_step!r}")
    # The frozen only: the compressors' comparison names a parameter some ranks lack.
    frozen = [names[p] for group in param_groups for p in group["params"]
              if not p.requires_grad]
    settings = {("frozen", name): "yes" for name in frozen}
    labels = {("frozen", name): f"whether '{name}' is frozen (requires_grad=False)"
              for name in frozen}
    settings.update(op=op.name.capitalize(),
                    gradient_predivide_factor=float(gradient_predivide_factor))
    if op != Adasum:       # Adasum's changes travel ungrouped and dense
        settings.update(groups=groups_setting(groups, names),
                        sparse_as_dense=bool(sparse_as_dense))
    return settings, labels
