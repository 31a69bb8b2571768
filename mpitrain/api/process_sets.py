"""Process sets: subsets of ranks with a communicator of their own."""

import sys

from mpitrain.errors import not_initialized_error


class ProcessSet:
    """A subset of the job's ranks that collectives can run on.

    Create one with a list of ranks, or with an mpi4py communicator (its
    ranks count in the communicator mpitrain was started on), and register
    it through ``init(process_sets=[...])`` or ``add_process_set``; every
    rank must register the same sets in the same order. At init, sets made
    from communicators may differ between ranks, as the parts of a
    ``Split`` do: each part is registered, and each rank's object is its own.
    """

    def __init__(self, ranks_or_comm):
        self.mpi_comm = None
        if _is_communicator(ranks_or_comm):
            if ranks_or_comm == sys.modules["mpi4py.MPI"].COMM_NULL:
                raise ValueError(
                    "ProcessSet got MPI.COMM_NULL: this rank is not in that "
                    "communicator; give every rank its part (comm.Split) or "
                    "pass a list of ranks")
            self.mpi_comm = ranks_or_comm
            self.ranks = []         # known once registered: see _resolve
        else:
            self.ranks = _normalize(ranks_or_comm)
        self.process_set_id = None
        self._my_rank = None        # this process's rank in the set, or None

    def _resolve(self, job_comm):
        """Ranks of a set made from a communicator, counted in ``job_comm``."""
        if self.mpi_comm is None:
            return
        ranks, job_group = self.mpi_comm.Get_group(), job_comm.Get_group()
        try:
            translated = ranks.Translate_ranks(list(range(ranks.Get_size())), job_group)
        finally:
            ranks.Free()
            job_group.Free()
        if sys.modules["mpi4py.MPI"].UNDEFINED in translated:
            raise ValueError("ProcessSet's communicator has processes outside the "
                             "communicator mpitrain was started on")
        self.ranks = sorted(translated)

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


def is_root(root_rank, process_set):
    """Whether this process is broadcast root ``root_rank`` (a rank of the job,
    as in Horovod) of ``process_set``; raises where it is not a member."""
    return process_set.ranks[process_set.rank()] == root_rank


def _is_communicator(value):
    """An mpi4py communicator (never true before mpi4py.MPI is imported)."""
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and isinstance(value, MPI.Comm)


def _normalize(ranks):
    if ranks is None:
        return []
    try:
        values = [int(r) for r in ranks]
    except TypeError:
        raise TypeError("ProcessSet takes a list of ranks or an mpi4py "
                        f"communicator, got {ranks!r}") from None
    if len(set(values)) != len(values):
        raise ValueError(f"ProcessSet ranks must be distinct, got {values}")
    if any(r < 0 for r in values):
        raise ValueError(f"ProcessSet ranks must be >= 0, got {values}")
    return sorted(values)


global_process_set = ProcessSet(None)
