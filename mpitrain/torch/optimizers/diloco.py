"""DiLoCoOptimizer: H local inner steps, then an outer step on the ranks' mean pseudo-gradient.

DiLoCo (Douillard et al., arXiv 2311.08105): each rank steps the wrapped
(inner) optimizer on its own gradients; every ``inner_steps`` steps the
ranks average their pseudo-gradients (the parameters after the last outer
step minus their own) and an outer optimizer, SGD with Nesterov momentum by
default, applies that mean as a gradient to the parameters of the last outer
step. LocalSGDOptimizer is the case of an outer SGD with lr 1 and no
momentum. Streaming DiLoCo (arXiv 2501.18512) syncs the model in fragments
at staggered steps, each overlapping the next inner steps
(diloco_fragments.py); the outer step and the global copy are
diloco_outer.py's.

The inner optimizer may be a DistributedOptimizer over another process set
(the ranks of a node): gradients averaged inside the node every step, DiLoCo
across nodes.
"""

import torch

from mpitrain.api.agreement import require_same
from mpitrain.api.process_sets import global_process_set
from mpitrain.torch.compression import Compression, choice
from mpitrain.torch.optimizers.diloco_fragments import Schedule, form_fragments
from mpitrain.torch.optimizers.diloco_outer import OuterLoop
from mpitrain.torch.optimizers.distributed import _DistributedOptimizer
from mpitrain.torch.optimizers.local_sgd import _LocalSGD
from mpitrain.torch.optimizers.parameter_names import parameter_names
from mpitrain.torch.wrapping import mixed_in, rewrapped

SETTINGS_NAME = "DiLoCoOptimizer.settings"
STATE_KEY = "diloco"


class _DiLoCo:
    """Mixed in before the inner optimizer's class; see DiLoCoOptimizer."""

    def step(self, closure=None):
        self._diloco.before_inner_step()
        result = super().step() if closure is None else super().step(closure)
        self._diloco.after_inner_step()
        return result

    def synchronize_parameters(self):
        """An outer step for the whole model now, on every rank of the set.

        For evaluating, saving the final model or stopping: afterwards every
        rank holds the same parameters (the new global copy). A fragment in
        flight lands first; the inner step count starts over.
        """
        self._diloco.synchronize_parameters()

    @property
    def outer_optimizer(self):
        return self._diloco.outer

    @property
    def bytes_sent(self):
        """The pseudo-gradient bytes this rank has submitted (after compression)."""
        return self._diloco.bytes_sent

    @property
    def exchanges(self):
        """How many fragment exchanges this rank has started."""
        return self._diloco.exchanges

    def state_dict(self):
        """The inner optimizer's state and, under "diloco", the global copy
        (by parameter name), the outer optimizer's state, the inner step
        count, a landed fragment not yet applied and the compressors' state."""
        state = super().state_dict()
        state[STATE_KEY] = self._diloco.state()
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict({key: value for key, value in state_dict.items()
                                 if key != STATE_KEY})
        if STATE_KEY in state_dict:
            self._diloco.load(state_dict[STATE_KEY])


_DiLoCo.step.hooked = True         # see _DistributedOptimizer.step


def DiLoCoOptimizer(optimizer, named_parameters=None, inner_steps=500, outer_optimizer=None,
                    compression=Compression.none, process_set=global_process_set,
                    fragments=1, overlap_steps=0, mixing=None):
    """Wrap ``optimizer`` (the inner one) for DiLoCo across ``process_set``.

    The result is an instance of the inner optimizer's class, sharing its
    state and parameter groups, whose step() is the inner step; every
    ``inner_steps`` of them each fragment takes an outer step.

    inner_steps: H, the inner steps between two outer steps of a fragment.
    outer_optimizer: a torch optimizer over the same parameters; default
        torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True), the paper's.
    compression: how pseudo-gradients travel: Compression.none, .fp16,
        .bf16, .int8, .int4 (or any compressor DistributedOptimizer takes,
        or a choice per parameter name).
    process_set: the ranks that average pseudo-gradients.
    fragments: F, the parts the model is synced in, fragment f landing
        after inner steps (f + 1) * H // F + k * H: a count (contiguous parts
        of about equal size, in the optimizer's order) or the parts
        themselves, modules or lists of parameters (each trained one once).
    overlap_steps: inner steps a fragment's exchange travels before it is
        applied (0: applied in the step that sends it); less than H // F.
    mixing: the weight of the local parameters when a fragment lands after
        overlap_steps: (1 - mixing) * global + mixing * local. Default 0.5
        with overlap (Streaming DiLoCo's alpha), 0 without.

    Every rank of the set passes the same inner_steps, fragments,
    overlap_steps, mixing and compression; otherwise each raises a
    MismatchError naming the option and the ranks' values.
    """
    if isinstance(optimizer, (_DiLoCo, _LocalSGD)):
        raise ValueError("DiLoCoOptimizer wraps a plain optimizer or a DistributedOptimizer, "
                         "not a LocalSGDOptimizer or another DiLoCoOptimizer")
    settings, labels, problem = {}, {}, None
    try:
        names = parameter_names(optimizer.param_groups, named_parameters)
        trained = [p for group in optimizer.param_groups for p in group["params"]
                   if p.requires_grad]
        if not trained:
            raise ValueError("the optimizer trains no parameter (none requires grad)")
        parts, fragments_setting = form_fragments(fragments, trained, names)
        _check_arguments(inner_steps, len(parts), overlap_steps, mixing)
        if mixing is None:
            mixing = 0.5 if overlap_steps else 0.0
        if outer_optimizer is None:
            outer_optimizer = torch.optim.SGD(trained, lr=0.7, momentum=0.9, nesterov=True)
        _check_outer(outer_optimizer, trained, names)
        wire_names = {p: f"DiLoCoOptimizer.{names[p]}" for p in trained}
        cast, chosen = choice.split(compression, trained, names)
        settings = {"inner_steps": inner_steps, "fragments": fragments_setting,
                    "overlap_steps": overlap_steps, "mixing": float(mixing),
                    "compression": getattr(cast, "__qualname__", repr(cast))}
        settings.update({("compressor", names[p]): repr(chosen[p]) if p in chosen
                         else "uncompressed" for p in trained})
        labels = {("compressor", names[p]): f"the compressor of '{names[p]}'"
                  for p in trained}
    except (TypeError, ValueError) as error:
        problem = error
    if process_set.included():
        # Ranks that send different fragments at different steps pair
        # exchanges that do not match, and the last one waits forever.
        require_same("DiLoCoOptimizer", settings, SETTINGS_NAME, process_set, problem,
                     labels, absent="no such parameter")
    elif problem:
        raise problem
    if isinstance(optimizer, _DistributedOptimizer):
        # Its gradient hooks hold it by a weak reference: keep the object.
        optimizer.__class__ = mixed_in(_DiLoCo, type(optimizer))
        wrapped = optimizer
    else:
        wrapped = rewrapped(optimizer, _DiLoCo)
    wrapped._diloco = OuterLoop(trained, parts, names, outer_optimizer,
                                Schedule(inner_steps, len(parts), overlap_steps), mixing,
                                cast, chosen, wire_names, process_set)
    return wrapped


def _whole(value, at_least):
    return not isinstance(value, bool) and isinstance(value, int) and value >= at_least


def _check_arguments(inner_steps, fragments, overlap_steps, mixing):
    """fragments: how many there are."""
    if not _whole(inner_steps, 1):
        raise ValueError(f"inner_steps must be a whole number >= 1, got {inner_steps!r}")
    if fragments > inner_steps:
        raise ValueError(f"{fragments} fragments cannot each sync once in inner_steps "
                         f"({inner_steps}) steps: at most one fragment lands a step")
    if not _whole(overlap_steps, 0) or overlap_steps >= inner_steps // fragments:
        raise ValueError("overlap_steps must be a whole number >= 0 and less than "
                         f"inner_steps // fragments ({inner_steps // fragments}), so that "
                         f"a fragment lands before the next leaves; got {overlap_steps!r}")
    if mixing is not None and (isinstance(mixing, bool) or not isinstance(mixing, (int, float))
                               or not 0 <= mixing <= 1):
        raise ValueError(f"mixing must be a number from 0 to 1, got {mixing!r}")


def _check_outer(outer_optimizer, trained, names):
    if not isinstance(outer_optimizer, torch.optim.Optimizer):
        raise TypeError("outer_optimizer must be a torch.optim.Optimizer, got "
                        f"{type(outer_optimizer).__name__}")
    outer = {p for group in outer_optimizer.param_groups for p in group["params"]}
    missing = [names[p] for p in trained if p not in outer]
    if missing:
        raise ValueError("outer_optimizer must be built over the parameters the inner "
                         f"optimizer trains; it lacks {', '.join(missing)}")
    extra = len(outer - set(trained))
    if extra:
        raise ValueError(f"outer_optimizer holds {extra} parameter(s) the inner "
                         "optimizer does not train")
