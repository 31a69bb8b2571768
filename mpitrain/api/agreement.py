"""Settings every rank must share, compared across the ranks where they are set.

A setting that differs between ranks (LocalSGD's period, the compressor of a
gradient) pairs different operations, or payloads that cannot be read
together: the job then hangs or computes nonsense. Comparing the settings
first turns that into a MismatchError on every rank that names the setting
and each rank's value. An allgather of one digest per rank says whether
the ranks agree; only when they do not do the settings themselves travel.
"""

import hashlib

import numpy as np

from mpitrain.api import array_ops
from mpitrain.api.objects import allgather_object
from mpitrain.api.process_sets import global_process_set
from mpitrain.engine.negotiation.coordinator import describe_by_rank
from mpitrain.errors import ERROR_CLASSES, MismatchError, RankNames


def require_same(what, settings, name, process_set=global_process_set, problem=None,
                 labels=None, absent="nothing"):
    """Return once every rank of ``process_set`` passed equal ``settings``.

    Otherwise raise on every rank: a MismatchError naming the first setting
    that differs and each rank's value, or, where some rank had a
    ``problem`` (the exception that kept it from making its settings), that
    exception on that rank and the error naming it on the others.

    what: who checks, for the message ("LocalSGDOptimizer"); settings: {key:
    value}, values compared by their repr; name: the collectives' name;
    labels: {key: how the message names it} (default: the key itself), so
    that a message may say more than what is compared; absent: what it
    shows for a rank that lacks a key the others have.
    """
    if process_set.size() == 1:             # alone: nothing to compare, nothing sent
        if problem:
            raise problem
        return
    if problem is None:
        mine = (None, settings, labels or {})
    else:
        mine = ("type" if isinstance(problem, TypeError) else "value",
                f"{type(problem).__name__}: {problem}", {})
    text = repr(mine if problem else sorted(
        (repr(key), repr(value)) for key, value in settings.items())).encode()
    digest = int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)
    # An allgather, not an allreduce: autotune times the allreduces of training.
    digests = array_ops.allgather(np.array([digest], dtype=np.int64), f"{name}.digest",
                                  process_set)
    if (digests == digest).all():
        if problem:
            raise problem
        return
    everyone = allgather_object(mine, f"{name}.settings", process_set)
    if problem:
        raise problem
    rank_names = RankNames(process_set.process_set_id, process_set.ranks)
    failed = [rank for rank, (kind, _, _) in enumerate(everyone) if kind is not None]
    if failed:
        raise ERROR_CLASSES[everyone[failed[0]][0]](
            f"{what} failed on {rank_names(failed)}: "
            + "; ".join(everyone[rank][1] for rank in failed))
    # Labels travel too: a rank that lacks a key has no label for it.
    labels = {key: label for _, _, theirs in reversed(everyone)
              for key, label in theirs.items()}
    everyone = [theirs for _, theirs, _ in everyone]
    for key in dict.fromkeys(key for theirs in everyone for key in theirs):
        values = [theirs.get(key, absent) for theirs in everyone]
        if len(set(map(repr, values))) > 1:
            shown = describe_by_rank({rank_names.job_ranks[rank]: value
                                      for rank, value in enumerate(values)})
            raise MismatchError(f"{what}: {labels.get(key, key)} differs between "
                                f"{rank_names.members} ({shown}): every rank must use "
                                "the same")

