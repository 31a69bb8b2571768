"""Streaming DiLoCo's fragments: which parameters sync together, when, and how.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) splits the model into
fragments that are synced one after another at staggered inner steps, so
that the bytes of one outer step are spread over the H inner steps instead
of crossing the wire at once. Each fragment still syncs once every H inner
steps. A fragment's pseudo-gradient may leave ``overlap_steps`` inner steps
before it is applied, travelling while those steps compute. With one
fragment and no overlap this is plain DiLoCo (arXiv 2311.08105).
"""

import torch

from mpitrain.ops import Average
from mpitrain.torch.compression.base import GradientCompressor
from mpitrain.torch.ops import grouped_allreduce_async_

EXCHANGE_NAME = "DiLoCoOptimizer.fragment"


def form_fragments(fragments, parameters, names):
    """(the fragments as lists of parameters, what the ranks compare of them).

    fragments: a count, split by split_into_fragments, or the fragments
    themselves in the order they sync: modules or lists of parameters,
    holding every trained parameter once (as torchft's DiLoCo takes modules).
    """
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        if fragments < 1:
            raise ValueError(f"fragments must be a whole number >= 1, got {fragments}")
        return split_into_fragments(parameters, fragments), fragments
    try:
        parts = [list(part.parameters() if isinstance(part, torch.nn.Module) else part)
                 for part in fragments]
    except TypeError:
        raise ValueError("fragments must be a whole number >= 1, or modules or lists of "
                         f"parameters; got a {type(fragments).__name__}") from None
    placed = [id(p) for part in parts for p in part]
    trained = {id(p) for p in parameters}
    missing = [names[p] for p in parameters if id(p) not in set(placed)]
    if missing:
        raise ValueError(f"fragments leave out {', '.join(missing)}: every trained "
                         "parameter belongs to one fragment")
    if len(placed) != len(set(placed)):
        raise ValueError("fragments hold a parameter twice: each trained parameter "
                         "belongs to one fragment")
    if set(placed) != trained or not all(parts):
        raise ValueError("fragments hold a parameter the optimizer does not train, or "
                         "an empty fragment")
    return parts, [[names[p] for p in part] for part in parts]


def split_into_fragments(parameters, count):
    """``parameters`` (in order) as ``count`` contiguous lists of about equal
    element counts, each non-empty; the same on every rank for the same model."""
    if count > len(parameters):
        raise ValueError(f"fragments={count} is more than the {len(parameters)} "
                         "trained parameters: a fragment needs one at least")
    total = sum(p.numel() for p in parameters)
    fragments, fragment, taken = [[] for _ in range(count)], 0, 0
    for index, p in enumerate(parameters):
        # On to the next fragment once this one holds its share of the
        # elements, or when every parameter left is needed to fill the rest.
        if fragments[fragment] and (taken * count >= (fragment + 1) * total
                                    or len(parameters) - index <= count - fragment - 1):
            fragment += 1
        fragments[fragment].append(p)
        taken += p.numel()
    return fragments


class Schedule:
    """At which inner steps each fragment's pseudo-gradient leaves and lands.

    Steps count from 1 (after the first inner step). Fragment f lands at
    the steps t with t = (f + 1) * H // F (mod H), as torchft's DiLoCo
    staggers them, and leaves ``overlap_steps`` steps earlier; one fragment
    at most is in flight at a time.
    """

    def __init__(self, inner_steps, fragments, overlap_steps):
        self.inner_steps = inner_steps
        self.lands = [(f + 1) * inner_steps // fragments for f in range(fragments)]
        self.leaves = [step - overlap_steps for step in self.lands]

    def leaving_at(self, step):
        """The fragment that leaves after inner step ``step``, or None."""
        return _fragment_at(self.leaves, step, self.inner_steps)

    def landing_at(self, step):
        """The fragment applied after inner step ``step``, or None."""
        return _fragment_at(self.lands, step, self.inner_steps)


def _fragment_at(steps, step, period):
    phase = step % period
    for fragment, at in enumerate(steps):
        if at % period == phase:
            return fragment
    return None


class PseudoGradientExchange:
    """The mean over the set's ranks of one fragment's pseudo-gradients, in flight.

    The tensors of the cast compressor (none, fp16, bf16) travel in one
    grouped allreduce; those a GradientCompressor takes (int8, int4, topk,
    ...) through its own exchange, which sums, divided here by the ranks.
    ``bytes_sent``: what this rank submitted, counted from the payloads.
    """

    def __init__(self, fragment, pseudo_gradients, parameters, cast, chosen, wire_names,
                 process_set):
        self.fragment = fragment
        self._size = process_set.size()
        self._means = None
        self._cast_positions, cast_tensors, self._contexts = [], [], []
        self._exchanges = []                # (position, exchange of a compressor)
        self.bytes_sent = 0
        for position, (p, pseudo) in enumerate(zip(parameters, pseudo_gradients)):
            compressor = chosen.get(p)
            if isinstance(compressor, GradientCompressor):
                before = compressor.bytes_sent
                self._exchanges.append((position, compressor.start(
                    pseudo, wire_names[p], process_set)))
                self.bytes_sent += compressor.bytes_sent - before
                continue
            tensor, context = cast.compress(pseudo)
            self._cast_positions.append(position)
            cast_tensors.append(tensor)
            self._contexts.append(context)
            self.bytes_sent += tensor.numel() * tensor.element_size()
        self._count = len(pseudo_gradients)
        self._cast = cast
        self._handle = None
        if cast_tensors:
            self._handle = grouped_allreduce_async_(
                cast_tensors, name=f"{EXCHANGE_NAME}{fragment}", op=Average,
                process_set=process_set)

    def means(self):
        """The mean pseudo-gradients, in the fragment's order (waits the first time)."""
        if self._means is None:
            means = [None] * self._count
            if self._handle is not None:
                results = self._handle.wait()
                for position, result, context in zip(self._cast_positions, results,
                                                     self._contexts):
                    means[position] = self._cast.decompress(result, context)
            for position, exchange in self._exchanges:
                means[position] = exchange.wait().div_(self._size)
            self._means = means
        return self._means


class Landed:
    """A fragment's mean pseudo-gradients already known (from a checkpoint, or
    on a rank alone in its set): the interface of PseudoGradientExchange."""

    bytes_sent = 0

    def __init__(self, fragment, means):
        self.fragment = fragment
        self._means = means

    def means(self):
        return self._means


def pseudo_gradients(global_copy, parameters):
    """global - local for each parameter: the inner steps' change with its sign
    turned, pointing as a gradient does."""
    with torch.no_grad():
        return torch._foreach_sub(list(global_copy), [p.detach() for p in parameters])
