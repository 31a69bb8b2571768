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
        return [h.wait() for h in self.handles]

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
