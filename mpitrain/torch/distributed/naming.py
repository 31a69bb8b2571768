"""How the "mpitrain" backend names the calls made on a process group.

torch's collectives carry no names; they pair up by their order. So every
rank's n-th call on a group travels as one name, the same whatever the call
is ('torch.distributed group 0 call 12'), with the torch function as its
place in the program. mpitrain's negotiation then pairs it with the other
ranks' n-th call and, where the calls differ (an all_reduce against a
broadcast, another shape, dtype, op or root), fails that call on every rank,
naming the ranks and what differed; a rank that never makes its n-th call
is named by the stall report.

A call made by a callback of another call's future (DDP's PowerSGD hook
makes two per bucket) is named after that call: 'call 12.then.0' is the
first call the callbacks of call 12 make. Those callbacks run on mpitrain's
threads while the user's thread makes its next calls, so one count for both
would pair them differently on each rank. A callback that torch runs at once
in the user's thread (the future had completed when ``then`` was called) is
named after the last call that thread made outside callbacks, which is the
call whose future ``then`` chains onto in hooks (``all_reduce(...).get_future()
.then(...)``).

Once a call on a group has failed, the ranks' counts may be out of step for
good (a rank skipped a call), so every later call on the group fails at
once with the first error, as NCCL's communicators stay aborted.
"""

import contextlib
import sys
import threading

import torch

from mpitrain.api.names import AutoName

_THEN = torch.futures.Future.then.__code__
_context = threading.local()      # .callbacks: [name, count] while a future's callbacks run
#                                   .last: [name, count] of this thread's last call


class GroupFailed(RuntimeError):
    """A call on a process group whose earlier call failed."""


class _Chain:
    """The calls made by the callbacks of call ``name``."""

    __slots__ = ("name", "count")

    def __init__(self, name):
        self.name = name
        self.count = 0

    def next(self):
        number, self.count = self.count, self.count + 1
        return f"{self.name}.then.{number}"


@contextlib.contextmanager
def callbacks_of(name):
    """Name the calls made meanwhile on this thread after call ``name``."""
    outer = getattr(_context, "callbacks", None)
    _context.callbacks = _Chain(name)
    try:
        yield
    finally:
        _context.callbacks = outer


def _inside_then():
    """Is this thread running a callback that torch's ``Future.then`` runs at once?"""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _THEN:
            return True
        frame = frame.f_back
    return False


class CallNames:
    """The numbering of one process group's calls, and its first failure."""

    def __init__(self, label):
        self.label = label
        self._count = 0
        self._lock = threading.Lock()
        self.first_error = None

    def next(self, call):
        """The name of this rank's next call on the group, made by torch's ``call``."""
        if self.first_error is not None:
            raise GroupFailed(
                f"{call} on {self.label}: an earlier call on this group failed, so its "
                f"ranks' calls no longer pair up: {self.first_error}. Create a new "
                "group (dist.new_group) or restart the job") from None
        chain = getattr(_context, "callbacks", None)
        if chain is None and _inside_then():
            chain = getattr(_context, "last", None)
        if chain is not None:
            return AutoName(chain.next(), call)
        with self._lock:
            number = self._count
            self._count += 1
        name = f"torch.distributed {self.label} call {number}"
        _context.last = _Chain(name)
        return AutoName(name, call)

    def failed(self, error):
        if self.first_error is None:
            self.first_error = f"{type(error).__name__}: {error}"
