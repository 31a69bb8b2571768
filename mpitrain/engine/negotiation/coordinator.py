"""The coordinator: rank 0 of a process set matches requests by name.

It counts which ranks submitted each name, validates the requests once all
ranks have (or have joined), and turns them into responses that every rank
executes in the same order. A mismatch becomes an error response, so the
operation fails on every rank instead of hanging.
"""

import dataclasses

from mpitrain.backends import dtypes
from mpitrain.engine import naming
from mpitrain.engine.negotiation.messages import Response
from mpitrain.engine.negotiation.refused import RefusedNames
from mpitrain.errors import RankNames
from mpitrain.ops import OpType, ReduceOp

_JOIN_ALLOWED = frozenset({OpType.ALLREDUCE})


class Coordinator:
    def __init__(self, size, rank_names=None):
        self.size = size
        self.rank_names = rank_names or RankNames(0, range(size))   # for its errors
        self.table = {}            # name -> {rank: Request}, in arrival order
        self.first_seen = {}       # name -> monotonic time of the first request
        self.joined = set()
        self.last_joined_rank = -1
        self.refused = RefusedNames()
        self.unnamed_stopped = {}  # kind label -> the mismatch that ended its numbering

    def receive(self, requests_by_rank, now):
        """Take every rank's new requests; return the responses now ready."""
        ready = []
        responses = []             # errors decided on the way
        join_changed = False
        for requests in requests_by_rank:
            for request in requests:
                if request.kind == OpType.JOIN:
                    self.joined.add(request.rank)
                    self.last_joined_rank = request.rank
                    join_changed = True
                    continue
                stopped = request.site and self.unnamed_stopped.get(
                    naming.numbered_kind(request.name))
                if stopped:
                    if not any(r.name == request.name for r in responses):
                        responses.append(_stopped(request.name, request.kind, stopped))
                    continue
                ranks = self.table.setdefault(request.name, {})
                ranks[request.rank] = request
                seen = now - request.age
                self.first_seen[request.name] = min(
                    self.first_seen.get(request.name, seen), seen)
                if self.refused:
                    self.refused.note(request)
                if request.name in ready:
                    continue
                if self._complete(ranks) or self._stood_in(request.name, responses):
                    self._ready(request.name, ready, responses)
                elif request.name_refused:
                    self._stand_in(request, ready, responses)
        if join_changed:
            for name, ranks in list(self.table.items()):
                if name not in ready and self._complete(ranks):
                    self._ready(name, ready, responses)
        for name in ready:
            if name not in self.table:
                continue           # failed by _stop_unnamed on the way
            self.first_seen.pop(name)
            requests = self.table.pop(name)
            response = build_response(name, requests, self.joined, self.rank_names)
            responses.append(response)
            if response.numbering_stopped:
                responses += self._stop_unnamed(name, response.error)
        if len(self.joined) == self.size:
            responses.append(Response(OpType.JOIN, "join",
                                      last_joined_rank=self.last_joined_rank))
            self.joined.clear()
        return responses

    def _complete(self, ranks):
        return len(ranks.keys() | self.joined) == self.size

    def _ready(self, name, ready, responses):
        """``name`` has every rank's request: its response is built this round.
        Stand-ins among them, and those of ranks that made it after theirs,
        can stand in for nothing else from now on."""
        ready.append(name)
        for lapsed in self.refused.paired(name, self.table[name]):
            if lapsed.name not in ready:
                self._retire(lapsed, responses)

    # -- names a rank refused (see mpitrain.engine.negotiation.refused) ------

    def _stand_in(self, request, ready, responses):
        """Let a request whose name its rank refused fail the oldest waiting
        call that it (with other ranks' stand-ins) completes, or keep it."""
        self.refused.add(request)
        for name, ranks in list(self.table.items()):
            if (name in self.table and name not in ready and request.rank not in ranks
                    and self._stood_in(name, responses)):
                self._ready(name, ready, responses)
                return

    def _stood_in(self, name, responses):
        """Do stand-ins of the ranks missing from ``name`` complete it? Then
        they join its requests, carrying their ranks' errors."""
        if not self.refused:
            return False
        ranks = self.table[name]
        missing = set(range(self.size)) - ranks.keys() - self.joined
        found = self.refused.stand_in(ranks, missing)
        if found is None:
            return False
        for rank, stand_in in found.items():
            self._retire(stand_in, responses)
            ranks[rank] = dataclasses.replace(stand_in, name=name)
        return True

    def _retire(self, stand_in, responses):
        """Fail the name a stand-in was submitted under, which no other rank
        will submit, so that its rank's engine lets it go."""
        requests = self.table.pop(stand_in.name, None)
        if requests is None:
            return
        self.first_seen.pop(stand_in.name)
        for request in requests.values():
            self.refused.discard(request)
        responses.append(build_response(stand_in.name, requests, self.joined,
                                        self.rank_names))

    # -- unnamed calls whose numbers went out of step (see mpitrain.engine.naming)

    def _stop_unnamed(self, name, error):
        """End the numbering of ``name``'s kind: its pending unnamed calls fail,
        and every later one."""
        label = naming.numbered_kind(name)
        self.unnamed_stopped[label] = error
        stopped = [pending for pending, ranks in self.table.items()
                   if naming.numbered_kind(pending) == label
                   and any(request.site for request in ranks.values())]
        failed = []
        for pending in stopped:
            self.first_seen.pop(pending)
            kind = next(iter(self.table.pop(pending).values())).kind
            failed.append(_stopped(pending, kind, error))
        return failed

    def waiting(self):
        """name -> (first seen, ranks that submitted) for every pending name."""
        return {name: (self.first_seen[name], set(ranks))
                for name, ranks in self.table.items()}


def build_response(name, requests, joined, rank_names):
    """Validate one name's requests from every rank and build its response;
    errors name ranks as ``rank_names`` (a RankNames) does."""
    ordered = [requests[rank] for rank in sorted(requests)]
    first = ordered[0]
    label = f"{first.kind.label} of '{name}'"
    failed = [r for r in ordered if r.error]
    if failed:
        kinds = {r.error_kind for r in failed}
        message = f"{label} failed on {rank_names([r.rank for r in failed])}: "
        if len(failed) == 1:
            message += failed[0].error
        else:
            jobs = rank_names.job_ranks
            message += "; ".join(f"rank {jobs[r.rank]}: {r.error}" for r in failed)
        return _error(name, kinds.pop() if len(kinds) == 1 else "value", message)
    problem = _mismatch(ordered)
    if problem:
        what, values = problem
        jobs = rank_names.job_ranks
        if what == _ROOTS:
            values = {rank: jobs[root] for rank, root in values.items()}
        values = describe_by_rank({jobs[rank]: value for rank, value in values.items()})
        response = _error(name, "mismatch", f"{label} failed: mismatched {what} across "
                                            f"{rank_names.members}: {values}")
        # Numbers out of step stay so: the later unnamed calls of this kind fail.
        response.numbering_stopped = what == _PLACES and bool(naming.numbered_kind(name))
        return response
    if joined and first.kind not in _JOIN_ALLOWED:
        return _error(name, "value",
                      f"{label} failed: {first.kind.label} is not supported while "
                      f"{rank_names(sorted(joined))} "
                      f"{'has' if len(joined) == 1 else 'have'} joined; "
                      "only allreduce works with join (use sparse_as_dense=True "
                      "in DistributedOptimizer)")
    response = Response(first.kind, name, dtype=first.dtype, shape=first.shape,
                        op=first.op, prescale=first.prescale,
                        postscale=first.postscale, root=first.root,
                        device=0 if first.device >= 0 else -1)
    if first.kind == OpType.ALLGATHER:
        response.shape = first.shape[1:]
        response.first_dims = tuple(r.shape[0] for r in ordered)
    elif first.kind in (OpType.ADD_PROCESS_SET, OpType.REMOVE_PROCESS_SET):
        response.extra = first.shape
    return response


def _error(name, kind, message):
    return Response(OpType.ERROR, name, error=message, error_kind=kind)


def _stopped(name, kind, first_error):
    return _error(name, "mismatch", f"{kind.label} of '{name}' failed: "
                                    + naming.stopped(kind.label, first_error))


def _dtype_name(code):
    return dtypes.BY_CODE[code].name


def _op_name(code):
    return ReduceOp(code).name.capitalize()


_ROOTS = "root ranks"        # of a broadcast: set ranks, which errors show in the job
_PLACES = ("places in the program (unnamed calls pair up in the order each rank makes "
           "them: name them, or make the same calls on every rank)")


def _mismatch(ordered):
    """(what, {set rank: value}) of the first parameter that differs, or None."""
    kind = ordered[0].kind
    checks = [("operations", lambda r: r.kind.label)]
    if any(r.site for r in ordered):
        # Unnamed calls pair by their order: a different place in the program
        # means a rank made one call more or fewer before this one.
        checks.append((_PLACES, lambda r: r.site))
    if kind in (OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST,
                OpType.ALLTOALL, OpType.REDUCESCATTER):
        checks += [("data types", lambda r: _dtype_name(r.dtype)),
                   ("devices", lambda r: "GPU" if r.device >= 0 else "CPU")]
    if kind in (OpType.ALLREDUCE, OpType.REDUCESCATTER):
        checks += [("reduction ops", lambda r: _op_name(r.op)),
                   ("prescale factors", lambda r: r.prescale),
                   ("postscale factors", lambda r: r.postscale)]
    if kind == OpType.BROADCAST:
        checks.append((_ROOTS, lambda r: r.root))
    if kind in (OpType.ALLGATHER, OpType.ALLTOALL):
        checks += [("numbers of dimensions", lambda r: len(r.shape)),
                   ("shapes beyond the first dimension", lambda r: r.shape[1:])]
    elif kind in (OpType.ADD_PROCESS_SET, OpType.REMOVE_PROCESS_SET):
        checks.append(("process sets", lambda r: list(r.shape)))
    else:
        checks.append(("shapes", lambda r: r.shape))
    for what, value_of in checks:
        values = {r.rank: value_of(r) for r in ordered}
        if len(set(map(repr, values.values()))) > 1:
            return what, values
    return None


def describe_by_rank(values):
    """'ranks 0, 2: (2, 3); rank 1: (4,)' from {rank: value}."""
    groups = {}
    for rank, value in sorted(values.items()):
        text = value if isinstance(value, str) else repr(value)
        groups.setdefault(text, []).append(rank)
    parts = []
    for text, ranks in groups.items():
        who = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{who} {', '.join(map(str, ranks))}: {text}")
    return "; ".join(parts)
