"""Adding and removing process sets while the job runs: a collective on every rank."""

from mpitrain.api import array_ops, basics
from mpitrain.api import startup
from mpitrain.api.process_sets import ProcessSet
from mpitrain.ops import OpType


def add_process_set(process_set):
    """Register a new process set; every rank must call this in the same order."""
    running = basics.engine()
    topology, sets = basics.topology(), basics.registered_sets()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    try:                             # a problem is reported by every rank
        process_set._resolve(topology.comm)
        problem = startup.ranks_problem(process_set.ranks, topology.size)
    except ValueError as error:
        problem = str(error)
    for existing in sets.values():
        if existing.ranks == process_set.ranks:
            problem = (f"a process set with ranks {process_set.ranks} is "
                       f"already registered: {existing!r}")
    set_id = array_ops.change_process_sets(
        running, OpType.ADD_PROCESS_SET, tuple(process_set.ranks), problem or None)
    process_set._attach(set_id, topology.rank)
    sets[set_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Unregister a process set on every rank.

    Its operations still in flight fail on every member that submitted them,
    except those whose data already moves, which finish; synchronize them
    first to have every result.
    """
    running = basics.engine()
    sets = basics.registered_sets()
    set_id = process_set.process_set_id
    problem = None            # reported by every rank, not only here
    if set_id is None or sets.get(set_id) is not process_set:
        problem = f"{process_set!r} is not registered"
    elif set_id == 0:
        problem = "the job-wide process set cannot be removed"
    array_ops.change_process_sets(running, OpType.REMOVE_PROCESS_SET,
                                  (-1 if problem else set_id,), problem)
    del sets[set_id]
    process_set._detach()
    return True
