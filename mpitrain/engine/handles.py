"""Waiting on handles: poll, synchronize, and groups of handles."""

import threading

# One condition for every handle: the engine notifies once per executed
# group, and a handle costs no lock of its own.
completed = threading.Condition()


class GroupHandle:
    """The pending results of a grouped call, in the order submitted."""

    __slots__ = ("handles",)

    def __init__(self, handles):
        self.handles = handles

    def done(self):
        return all(h.done() for h in self.handles)

    def wait(self):
        results, errors = synchronize_all(self.handles)
        if errors:
            raise errors[0]
        return results

    def __repr__(self):
        return f"<mpitrain group of {len(self.handles)} handles>"


def notify_waiters():
    with completed:
        completed.notify_all()


def poll(handle):
    """True when ``handle`` has completed (successfully or not)."""
    return handle.done()


def synchronize(handle):
    """Wait for ``handle`` and return its result, or raise its error."""
    return handle.wait()


def synchronize_all(handles):
    """Wait for every handle, even after one fails; returns (results, errors).

    A failed handle's result is None. Raising at the first failure would
    leave the rest in flight, and their names could not be submitted again
    at once.
    """
    results, errors = [], []
    for handle in handles:
        try:
            results.append(handle.wait())
        except Exception as error:
            results.append(None)
            errors.append(error)
    return results, errors
