"""ShardedOptimizer's stage 1 (ZeRO-1): whole parameters owned by one rank each.

Each trained parameter belongs to one rank, chosen greedily by size so that
every rank owns about 1/N of the bytes (as PyTorch's ZeroRedundancyOptimizer
does): whole parameters, never slices of one, so any torch optimizer runs
unchanged on its rank's parameters, including those whose update depends on
a whole tensor (LAMB, LARS, Adafactor). Every rank keeps every gradient
until step(), which reduce-scatters them so that each rank receives the
average of those it owns, lets the local optimizer update them, and
allgathers the updated parameters. Each dtype travels in one flat buffer,
split into N equal segments: segment r holds rank r's parameters back to
back (padded to the longest segment).
"""

from collections import defaultdict

import torch

from mpitrain.api.handles import synchronize
from mpitrain.ops import Average, OpType
from mpitrain.torch.ops import grouped_allgather_async, grouped_reducescatter_async
from mpitrain.torch.optimizers.sharded_checks import for_every_rank

GRADIENTS, PARAMETERS = "ShardedOptimizer.gradients", "ShardedOptimizer.parameters"


class WholeParameters:
    """Which rank owns which parameter, and the exchanges of a stage 1 step.

    ``index``: every parameter's position in the optimizer's param_groups.
    """

    def __init__(self, trained, index, size, rank):
        self._size, self._index = size, index
        self._owner = _owners(trained, size)
        self._rank = rank
        self._layouts = _layouts(trained, self._owner, size, rank)
        self._alone = size == 1 or not self._layouts

    def local_groups(self, groups):
        """The groups of the local optimizer: this rank's parameters of each."""
        return [{**group, "params": [p for p in group["params"]
                                     if self._owner.get(p) == self._rank]}
                for group in groups]

    def exchanged(self):
        """(bytes this rank gives the reduce-scatters, bytes it gives the
        allgathers) in a step."""
        if self._alone:
            return 0, 0
        segments = sum(layout.segment * layout.dtype.itemsize for layout in self._layouts)
        return self._size * segments, segments

    # -- a step ---------------------------------------------------------------

    def reduce(self, closure):
        """The closure's loss, after which each owned parameter's ``.grad`` is
        the average of every rank's gradient."""
        if self._alone:
            return closure()
        loss, flats = for_every_rank(OpType.REDUCESCATTER, [GRADIENTS], lambda: (
            closure(), self._flat_gradients()), count=len(self._layouts))
        self._take_averages(synchronize(grouped_reducescatter_async(
            flats, name=GRADIENTS, op=Average)))
        return loss

    def update(self, local_step):
        """Run ``local_step`` (the local optimizer's step), then give every rank
        the parameters it updated."""
        if self._alone:
            local_step()
            return
        segments = for_every_rank(OpType.ALLGATHER, [PARAMETERS], lambda: (
            local_step(), self._segments())[1], count=len(self._layouts))
        self._take_parameters(synchronize(grouped_allgather_async(segments,
                                                                  name=PARAMETERS)))

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

    @torch.no_grad()
    def _segments(self):
        """This rank's updated parameters, a segment per dtype."""
        segments = []
        for layout in self._layouts:
            segment = torch.zeros(layout.segment, dtype=layout.dtype, device=layout.device)
            for p, start in layout.mine:
                segment[start:start + p.numel()].copy_(p.reshape(-1))
            segments.append(segment)
        return segments

    @torch.no_grad()
    def _take_parameters(self, gathered):
        for layout, flat in zip(self._layouts, gathered):
            for p, start in layout.theirs:
                p.copy_(flat[start:start + p.numel()].view_as(p))

    # -- state ----------------------------------------------------------------

    def shard_state(self, local):
        """This rank's share of the state, keyed by parameter index."""
        ids = [p for group in local.param_groups for p in group["params"]]
        return {self._index[ids[i]]: state for i, state in local.state_dict()["state"].items()}

    @staticmethod
    def merge(shares):
        """The full state by parameter index, from every rank's share_state()."""
        state = {}
        for share in shares:
            state.update(share)
        return state

    def local_state(self, state, local):
        """The local optimizer's "state" entries (by its positions) in ``state``
        (by parameter index)."""
        ids = [p for group in local.param_groups for p in group["params"]]
        return {position: state[self._index[p]] for position, p in enumerate(ids)
                if self._index[p] in state}

    def forget(self):
        """Nothing is in flight between stage 1 steps."""


class _Layout:
    """Where each parameter of one dtype sits in the flat buffer of N segments."""

    def __init__(self, dtype, device, segment, places, rank):
        """places: (parameter, owner, offset in the owner's segment)."""
        self.dtype, self.device, self.segment = dtype, device, segment
        self.starts = [(p, owner * segment + offset) for p, owner, offset in places]
        self.mine = [(p, offset) for p, owner, offset in places if owner == rank]
        self.theirs = [(p, owner * segment + offset) for p, owner, offset in places
                       if owner != rank]


def _owners(parameters, size):
    """Each parameter's rank: the largest first, each to the least loaded rank."""
    load = [0] * size
    owner = {}
    for p in sorted(parameters, key=lambda p: -p.numel() * p.element_size()):
        rank = load.index(min(load))
        owner[p] = rank
        load[rank] += p.numel() * p.element_size()
    return owner


def _layouts(parameters, owner, size, rank):
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
        layouts.append(_Layout(dtype, by_dtype[dtype][0].device, max(filled), places, rank))
    return layouts
