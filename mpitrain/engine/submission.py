"""The user-thread side of the engine: a call's handles join their set's queue.

Engine.enqueue and enqueue_many call these with the engine's lock held, from
user and framework threads. A handle is claimed (its arrays may not be in use
by another operation in flight), then recorded under its name in the set's
in-flight table and queued for the next round. A name still in flight may be
submitted again only behind a handle that failed locally: that one travels
only to fail the name on the other ranks, and the new one follows it. An
unnamed call gets its name here too, numbered per kind in program order.
"""

from mpitrain.engine import naming


def automatic_name(controller, kind):
    """The name of an unnamed call (a naming.AutoName): names count per kind.

    Ranks must make the same unnamed calls in the same order. The call site
    travels with the request, so that a rank that made one call more fails
    at the first wrong pairing. Only one thread may make unnamed calls: two
    interleave differently on each rank.
    """
    site = naming.call_site()
    with controller.links.lock:
        return controller.numbering.take(kind, site)


def accept(controller, entry):
    """Queue one handle; returns the claim conflict it carries, or None."""
    existing = controller.in_flight.get(entry.name)
    if existing is not None:
        existing = _last_failed(existing, controller)
    conflict = None if entry.failed_locally else controller.claims.claim(entry)
    if conflict is not None:
        _fail_locally(entry, conflict)
    if existing is None:
        controller.in_flight[entry.name] = entry
        controller.incoming.append(entry)
    else:
        existing.successor = entry
    return conflict


def accept_many(controller, entries):
    """Queue a grouped call's handles together, so one round sees them all.

    Repeated names, or a name still in flight behind no local failure, are a
    ValueError and queue nothing. Returns, as accept does, a conflict over
    arrays: then every entry carries it.
    """
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"a grouped call repeats names: {names}")
    behind = {name: _last_failed(controller.in_flight[name], controller)
              for name in names if name in controller.in_flight}
    conflict = _claim_all(controller.claims, entries)
    for name, entry in zip(names, entries):
        if name in behind:
            behind[name].successor = entry
        else:
            controller.in_flight[name] = entry
            controller.incoming.append(entry)
    return conflict


def _fail_locally(entry, conflict):
    entry.failed_locally = True
    entry.error = conflict
    entry.error_kind = "value"


def _claim_all(claims, entries):
    """Claim every entry's arrays, or none: the first conflict fails them all."""
    for entry in entries:
        conflict = None if entry.failed_locally else claims.claim(entry)
        if conflict is not None:
            for other in entries:
                if other.claimed is not None:
                    claims.release(other)
                _fail_locally(other, conflict)
            return conflict
    return None


def _last_failed(entry, controller):
    """The last entry queued under ``entry``'s name, which a new submission
    may wait behind only if it failed locally (its error is on its way to
    the other ranks); otherwise the name is still in use."""
    while entry.successor is not None:
        entry = entry.successor
    if not entry.failed_locally:
        raise _duplicate(entry.name, controller)
    return entry


def _duplicate(name, controller):
    return ValueError(
        f"an operation named '{name}' is already in flight on this rank (process "
        f"set {controller.set_id}); synchronize it before reusing the name, or pick "
        "another name")
