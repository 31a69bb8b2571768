"""DiLoCo's outer loop: the global copy of the parameters and the outer steps.

Every rank keeps the parameters as they were after the last outer step (the
global copy). When a fragment lands, its parameters are set back to the
global copy, the ranks' mean pseudo-gradient (global - local) becomes their
gradient, and the outer optimizer steps them: they become the new global
copy. That is DiLoCo's outer update, with any torch optimizer as the outer
one. Where the fragment travelled while inner steps ran (overlap), the
parameters are then mixed with what those steps made of them:
``(1 - mixing) * global + mixing * local``.
"""

import contextlib

import torch

from mpitrain.errors import MpitrainInternalError
from mpitrain.torch.compression import choice
from mpitrain.torch.optimizers.diloco_fragments import (Landed, PseudoGradientExchange,
                                                        pseudo_gradients)


class OuterLoop:
    """The global copy, the outer optimizer, the inner step count, the fragment in flight.

    parameters: the trained parameters in order; fragments: lists of them;
    names: {parameter: name} (the keys of the saved global copy); cast and
    chosen: what compresses each pseudo-gradient (compression/choice.py);
    wire_names: {parameter: the name its pseudo-gradient travels under}.
    """

    def __init__(self, parameters, fragments, names, outer_optimizer, schedule, mixing,
                 cast, chosen, wire_names, process_set):
        self.parameters = parameters
        self.fragments = fragments
        self.names = names
        self.outer = outer_optimizer
        self.schedule = schedule
        self.mixing = mixing
        self.cast, self.chosen, self.wire_names = cast, chosen, wire_names
        self.process_set = process_set
        self.syncs = process_set.included()
        self.inner_steps_taken = 0
        self.global_copy = None         # {parameter: tensor}, from the first inner step on
        self.in_flight = None           # a PseudoGradientExchange or Landed
        self.bytes_sent = 0             # by this rank, in pseudo-gradient payloads
        self.exchanges = 0              # fragments sent by this rank

    def before_inner_step(self):
        """Take the global copy before the first inner step changes the
        parameters (after broadcast_parameters, so it is the same everywhere)."""
        if self.global_copy is None and self.syncs:
            self.global_copy = {p: p.detach().clone() for p in self.parameters}

    def after_inner_step(self):
        if not self.syncs:
            return
        self.inner_steps_taken += 1
        leaving = self.schedule.leaving_at(self.inner_steps_taken)
        if leaving is not None:
            self._send(leaving)
        if self.schedule.landing_at(self.inner_steps_taken) is not None:
            self._land(self.mixing)

    def synchronize_parameters(self):
        """Land the fragment in flight, then an outer step for every fragment
        now, without mixing: every rank holds the new global copy. The
        schedule starts over."""
        if not self.syncs:
            return
        self.before_inner_step()
        if self.in_flight is not None:
            self._land(0.0)
        for fragment in range(len(self.fragments)):
            self._send(fragment)
            self._land(0.0)
        self.inner_steps_taken = 0

    def _send(self, fragment):
        parameters = self.fragments[fragment]
        pseudo = pseudo_gradients([self.global_copy[p] for p in parameters], parameters)
        if self.process_set.size() == 1:        # the mean of one is itself
            self.in_flight = Landed(fragment, pseudo)
        else:
            self.in_flight = PseudoGradientExchange(fragment, pseudo, parameters,
                                                    self.cast, self.chosen,
                                                    self.wire_names, self.process_set)
        self.bytes_sent += self.in_flight.bytes_sent
        self.exchanges += 1

    def _land(self, mixing):
        exchange, self.in_flight = self.in_flight, None
        parameters = self.fragments[exchange.fragment]
        means = exchange.means()
        everything = [p for group in self.outer.param_groups for p in group["params"]]
        # The outer optimizer steps only this fragment: the others get no gradient.
        inner_gradients = [p.grad for p in everything]
        with torch.no_grad():
            local = [p.detach().clone() for p in parameters] if mixing else None
            for p in everything:
                p.grad = None
            for p, mean in zip(parameters, means):
                p.copy_(self.global_copy[p])
                p.grad = mean
            self.outer.step()
            for p in parameters:
                self.global_copy[p].copy_(p)
            if mixing:
                torch._foreach_lerp_([p.detach() for p in parameters], local, mixing)
        for p, gradient in zip(everything, inner_gradients):
            p.grad = gradient

    # -- state -----------------------------------------------------------------

    def state(self):
        """What a checkpoint and elastic state keep. A fragment in flight is
        waited for: its mean is kept, to be applied at its step as planned."""
        state = {"inner_steps_taken": self.inner_steps_taken,
                 "outer_optimizer": self.outer.state_dict(),
                 "global_copy": None if self.global_copy is None else
                 {self.names[p]: tensor for p, tensor in self.global_copy.items()}}
        if self.in_flight is not None:
            state["landed"] = {"fragment": self.in_flight.fragment,
                               "means": self.in_flight.means()}
        compression = choice.state(self.chosen, self.wire_names, self.process_set.rank()
                                   if self.process_set.included() else -1)
        if compression is not None:
            state["compression"] = compression
        return state

    def load(self, state):
        if self.in_flight is not None:
            # Frees its name for the next exchange; where a rank failed (an
            # elastic reset) it failed with everything in flight.
            with contextlib.suppress(MpitrainInternalError):
                self.in_flight.means()
        self.inner_steps_taken = state["inner_steps_taken"]
        self.outer.load_state_dict(state["outer_optimizer"])
        saved = state["global_copy"]
        if saved is None:
            self.global_copy = None
        else:
            missing = [self.names[p] for p in self.parameters if self.names[p] not in saved]
            if missing:
                raise ValueError("the DiLoCoOptimizer state has no global copy of "
                                 f"{', '.join(missing)}")
            self.global_copy = {p: saved[self.names[p]].detach().to(p.device, p.dtype)
                                .clone() for p in self.parameters}
        landed = state.get("landed")
        self.in_flight = None
        if landed is not None:
            parameters = self.fragments[landed["fragment"]]
            self.in_flight = Landed(landed["fragment"], [
                mean.to(p.device, p.dtype) for mean, p in zip(landed["means"], parameters)])
        if "compression" in state:
            choice.load(self.chosen, self.wire_names, state["compression"],
                        self.process_set.rank() if self.process_set.included() else -1)
