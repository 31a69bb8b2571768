"""Collectives on picklable Python objects, built on the array collectives.

Objects travel pickled (protocol 5); objects beyond 2 GiB work, because the
array collectives move such bytes in pieces below MPI's count limit.
"""

import pickle

import numpy as np

from mpitrain.api import array_ops
from mpitrain.api.process_sets import global_process_set, is_root
from mpitrain.engine import naming
from mpitrain.errors import CollectiveTypeError, RankNames
from mpitrain.ops import OpType


def _bytes(obj):
    return np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)


def _pickled(obj, name, kind, process_set):
    """``obj``'s bytes; if it cannot be pickled, operation ``name`` fails on every rank."""
    try:
        return _bytes(obj)
    except Exception as error:      # whatever pickle raises, every rank must hear it
        array_ops.fail(kind, name, process_set, "type",
                       f"the object cannot be pickled: {type(error).__name__}: {error}")


def _name(name, kind):
    """The name the object's arrays travel under.

    An unnamed call's is the same on every rank whatever ran before: ranks'
    counts of unnamed calls can differ once one rank's call was refused (an
    allgather under join). Horovod names it by the object's type, which can
    differ between ranks too (broadcast_object(None) on the receivers); here
    it is the kind of call. Calls are synchronous, so no two share the name
    in flight; the call's place in the program travels with every piece.
    """
    if name is not None:
        return name
    return naming.AutoName(f"{kind.label}_object.noname", naming.call_site())


def _unpickled(data, source, problems):
    """The object pickled in ``data`` by job rank ``source``, or None after noting
    in ``problems`` why this rank cannot unpickle it."""
    try:
        return pickle.loads(data)
    except Exception as error:       # a class only the sender has, a broken pickle...
        problems.append(f"rank {source}'s object cannot be unpickled here: "
                        f"{type(error).__name__}: {error}")
        return None


def _agree(label, name, problems, process_set):
    """Raise on every rank if any rank could not unpickle what it received."""
    mine = "; ".join(problems)
    ok, report = naming.derived(name, ".ok"), naming.derived(name, ".problems")
    # An allgather, not an allreduce: autotune times the allreduces of training.
    if not array_ops.allgather(np.array([len(mine)], dtype=np.int64), ok,
                               process_set).any():
        return
    reports = allgather_object(mine, report, process_set)
    rank_names = RankNames(process_set.process_set_id, process_set.ranks)
    raise CollectiveTypeError(f"{label} of '{name}' failed: " + "; ".join(
        f"on {rank_names([rank])}, {report}"
        for rank, report in enumerate(reports) if report))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return root_rank's ``obj`` on every rank of the set (root_rank is a
    rank of the job, as in Horovod).

    Where a rank cannot unpickle it, every rank raises, naming that rank.
    """
    name = _name(name, OpType.BROADCAST)
    size_name, bytes_name = naming.derived(name, ".size"), naming.derived(name, ".bytes")
    sends = is_root(root_rank, process_set)
    data = _pickled(obj, size_name, OpType.BROADCAST, process_set) if sends else None
    size = np.array([0 if data is None else data.size], dtype=np.int64)
    size = array_ops.broadcast(size, root_rank, size_name, process_set)
    if data is None:
        data = np.empty(int(size[0]), dtype=np.uint8)
    array_ops.synchronize(array_ops.broadcast_async(
        data, root_rank, bytes_name, process_set, output=data))
    problems = []
    result = obj if sends else _unpickled(data, root_rank, problems)
    _agree("broadcast_object", name, problems, process_set)
    return result


def allgather_object(obj, name=None, process_set=global_process_set):
    """Return a list with every rank's ``obj``, in rank order.

    Where a rank cannot unpickle another's object, every rank raises, naming both.
    """
    name = _name(name, OpType.ALLGATHER)
    sizes_name, bytes_name = naming.derived(name, ".sizes"), naming.derived(name, ".bytes")
    data = _pickled(obj, sizes_name, OpType.ALLGATHER, process_set)
    sizes = array_ops.allgather(np.array([data.size], dtype=np.int64), sizes_name,
                                process_set)
    gathered = array_ops.allgather(data, bytes_name, process_set)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    problems = []
    results = [_unpickled(gathered[offsets[r]:offsets[r + 1]], process_set.ranks[r],
                          problems) for r in range(len(sizes))]
    _agree("allgather_object", name, problems, process_set)
    return results
