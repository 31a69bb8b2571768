"""Handles: what an asynchronous call returns, and how callers wait on it."""

import threading

# One condition for every handle: the engine notifies once per round, and a
# handle costs no lock of its own.
_completed = threading.Condition()


class Handle:
    """The pending result of one collective call."""

    __slots__ = ("name", "_done", "_value", "_error")

    def __init__(self, name):
        self.name = name
        self._done = False
        self._value = None
        self._error = None

    def done(self):
        return self._done

    def set_result(self, value):
        self._value = value
        self._done = True

    def set_error(self, error):
        self._error = error
        self._done = True

    def wait(self):
        if not self._done:
            with _completed:
                while not self._done:
                    _completed.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self):
        state = "done" if self._done else "pending"
        return f"<mpitrain handle {self.name!r} {state}>"


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
    with _completed:
        _completed.notify_all()


def poll(handle):
    """True when ``handle`` has completed (successfully or not)."""
    return handle.done()


def synchronize(handle):
    """Wait for ``handle`` and return its result, or raise its error."""
    return handle.wait()
