"""Process sets: subsets of ranks with a communicator of their own."""

from mpitrain.errors import not_initialized_error


class ProcessSet:
    """A subset of the job's ranks that collectives can run on.

    Create one with a list of ranks and register it through
    ``init(process_sets=[...])`` or ``add_process_set``; every rank must
    register the same sets in the same order.
    """

    def __init__(self, ranks):
        self.ranks = _normalize(ranks)
        self.process_set_id = None
        self._my_rank = None        # this process's rank in the set, or None

    def _attach(self, process_set_id, global_rank):
        self.process_set_id = process_set_id
        self._my_rank = (self.ranks.index(global_rank)
                         if global_rank in self.ranks else None)

    def _detach(self):
        self.process_set_id = None
        self._my_rank = None

    def _require_registered(self):
        if self.process_set_id is None and self is global_process_set:
            raise not_initialized_error()
        if self.process_set_id is None:
            raise ValueError(
                f"{self!r} is not registered: pass it to init(process_sets=...) "
                "or add_process_set() on every rank first")

    def size(self):
        self._require_registered()
        return len(self.ranks)

    def included(self):
        self._require_registered()
        return self._my_rank is not None

    def rank(self):
        """This process's rank within the set."""
        if not self.included():
            raise ValueError(f"this process is not a member of {self!r}")
        return self._my_rank

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


def _normalize(ranks):
    if ranks is None:
        return []
    try:
        values = [int(r) for r in ranks]
    except TypeError:
        raise TypeError(
            "ProcessSet takes a list of ranks; mpi4py communicators are not "
            "supported, pass comm.allgather(world_rank) instead") from None
    if len(set(values)) != len(values):
        raise ValueError(f"ProcessSet ranks must be distinct, got {values}")
    if any(r < 0 for r in values):
        raise ValueError(f"ProcessSet ranks must be >= 0, got {values}")
    return sorted(values)


global_process_set = ProcessSet(None)
