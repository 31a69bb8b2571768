"""Which parameters a DistributedOptimizer compresses, and with what."""

from mpitrain.api.agreement import require_same
from mpitrain.api.compression import chosen_compressor, saved_states
from mpitrain.torch.compression.base import GradientCompressor
from mpitrain.torch.compression.casts import NoneCompressor


def split(compression, parameters, names):
    """(the Horovod compressor of the fused allreduces, {parameter: GradientCompressor}).

    ``compression`` is a Horovod compressor (all parameters, fused), a
    GradientCompressor (the parameters it ``applies_to``; the rest go
    uncompressed), or a choice per parameter: a dict of names or a function
    of (name, parameter), giving a GradientCompressor or None (uncompressed).
    """
    if isinstance(compression, GradientCompressor):
        return NoneCompressor, {p: compression for p in parameters
                                if compression.applies_to(p)}
    if isinstance(compression, dict):
        unknown = set(compression) - {names[p] for p in parameters}
        if unknown:
            raise ValueError(f"compression names {', '.join(sorted(unknown))}, which "
                             "the optimizer does not train")
        return NoneCompressor, _chosen(parameters, names,
                                       lambda name, p: compression.get(name))
    if callable(compression) and not isinstance(compression, type):
        return NoneCompressor, _chosen(parameters, names, compression)
    return compression, {}


def agreed_split(compression, parameters, names, process_set):
    """split(), the same on every rank of ``process_set``, or a MismatchError on
    each naming the first parameter whose compressor or settings differ, or
    that only some ranks train.

    Payloads of different compressors, or of one with other settings, cannot
    be read together, and a compressed exchange would wait forever for a rank
    that sends its gradient uncompressed. A rank whose choice fails (a dict
    naming unknown parameters) fails every rank.
    """
    if not process_set.included():
        return split(compression, parameters, names)
    fused, chosen, problem = compression, {}, None
    try:
        fused, chosen = split(compression, parameters, names)
    except ValueError as error:
        problem = error
    require_same("DistributedOptimizer(compression=...)",
                 {names[p]: repr(chosen[p]) if p in chosen else "uncompressed"
                  for p in parameters},
                 "DistributedOptimizer.compression", process_set, problem,
                 labels={names[p]: f"the compressor of '{names[p]}'" for p in parameters},
                 absent="no such parameter")
    return fused, chosen


def _chosen(parameters, names, choose):
    chosen = {}
    for p in parameters:
        compressor = chosen_compressor(choose(names[p], p), names[p], "parameter",
                                       NoneCompressor, GradientCompressor)
        if compressor is not None:
            chosen[p] = compressor
    return chosen


def state(chosen, names, rank):
    """What the optimizer's state_dict keeps for its compressors (None if nothing)."""
    return saved_states({names[p]: compressor.state(names[p])
                         for p, compressor in chosen.items()}, rank)


def load(chosen, names, saved, rank):
    """Take back ``state``'s result; residuals only when this rank saved them."""
    for p, compressor in chosen.items():
        value = saved["parameters"].get(names[p])
        if value is not None:
            compressor.load_state(names[p], value, own=saved["rank"] == rank)
