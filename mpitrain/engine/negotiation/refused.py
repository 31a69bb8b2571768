"""Calls whose name a rank refused: which call of the other ranks' each stands for.

A name that is no string (a list, by mistake) fails its call on that rank at
once, and the name the other ranks gave the same call is not known there.
Its request still travels to the coordinator, marked, and stands for the
oldest waiting call of the same kind, data type and shape that only ranks
with such requests have not submitted: that call fails on every rank with
the refusing rank's error, instead of waiting for the stall shutdown. A
stand-in lapses once its rank has made a later call that paired up: its
program has moved past the refused call.
"""

from mpitrain.ops import OpType

_ANY_FIRST_DIMENSION = frozenset({OpType.ALLGATHER, OpType.ALLTOALL})


class RefusedNames:
    """The coordinator's stand-ins, per rank, oldest first. Each also waits in
    the coordinator's table under its own name, which ranks that gave the same
    text still pair with."""

    def __init__(self):
        self.waiting = {}         # rank -> its stand-in requests
        self.later = {}           # rank -> names it requested after its stand-ins

    def __bool__(self):
        return bool(self.waiting)

    def add(self, request):
        self.waiting.setdefault(request.rank, []).append(request)

    def discard(self, request):
        """Forget ``request``, if it is a stand-in (its own name was answered)."""
        if request in self.waiting.get(request.rank, ()):
            self._take(request)

    def note(self, request):
        """A request of a rank with stand-ins: should it pair up, they lapse."""
        if request.rank in self.waiting:
            self.later.setdefault(request.rank, set()).add(request.name)

    def paired(self, name, requests):
        """``name`` paired up: ``requests``, {rank: request}, are answered.
        Returns the stand-ins that lapse."""
        lapsed = []
        for rank, request in requests.items():
            if request.name_refused:
                self.discard(request)
            elif name in self.later.get(rank, ()):
                lapsed += self.waiting.pop(rank)
                del self.later[rank]
        return lapsed

    def stand_in(self, requests, missing):
        """{rank: its stand-in} for every rank of ``missing``, which have not
        made the call that ``requests`` (the others') make; taken out. None
        where some rank of ``missing`` has none that fits."""
        model = next(iter(requests.values()))
        chosen = {}
        for rank in missing:
            chosen[rank] = next((request for request in self.waiting.get(rank, ())
                                 if _fits(request, model)), None)
            if chosen[rank] is None:
                return None
        for request in chosen.values():
            self._take(request)
        return chosen

    def _take(self, request):
        rank = request.rank
        self.waiting[rank].remove(request)
        if not self.waiting[rank]:
            del self.waiting[rank]
            self.later.pop(rank, None)


def _fits(stand_in, request):
    """Could ``stand_in`` be the same call as ``request``, named by another rank?"""
    shape, theirs = stand_in.shape, request.shape
    if request.kind in _ANY_FIRST_DIMENSION:
        shape, theirs = shape[1:], theirs[1:]
    return (stand_in.kind == request.kind and stand_in.dtype == request.dtype
            and shape == theirs)
