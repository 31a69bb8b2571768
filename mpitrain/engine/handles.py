"""Handles: one operation submitted on this rank, later its result, and the waits on them.

Async calls return a Handle, ``poll`` and ``synchronize`` read it, and the
engine keeps it while the operation is in flight: one object per call keeps
the submission path short. Grouped calls return a GroupHandle of them.
"""

import threading
import time

from mpitrain.engine.negotiation.messages import Request
from mpitrain.ops import OpType

# One condition for every handle: the engine notifies once per executed
# group, and a handle costs no lock of its own.
completed = threading.Condition()

QUEUED, CACHED, SENT = range(3)
_ALLTOALL = OpType.ALLTOALL   # waiting to be sorted, served by the cache, at the coordinator


def signature(kind, dtype_code, shape, op, prescale, postscale, root, device=-1, site=""):
    """What must be identical for a cached response to serve a request.

    Alltoall may send a different number of rows each time; its other
    dimensions must still match. Of the device, only CPU or GPU matters. An
    unnamed call's place in the program (site) must match too.
    """
    if kind == _ALLTOALL:
        shape = shape[1:]
    return (kind, dtype_code, shape, op, prescale, postscale, root, device >= 0, site)


class Handle:
    """The pending result of one collective call on this rank."""

    __slots__ = ("name", "kind", "rank", "dtype", "shape", "op", "prescale",
                 "postscale", "root", "input", "output", "device", "ready", "splits",
                 "site", "signature", "claimed",
                 "enqueued", "state", "slot", "generation", "successor", "error",
                 "error_kind", "failed_locally", "name_refused", "result", "error_raised",
                 "_done")

    def __init__(self, name, kind, rank, dtype, shape, op=0, prescale=1.0,
                 postscale=1.0, root=-1, input=None, output=None, device=-1, site=""):
        self.name = name
        self.kind = kind
        self.rank = rank                  # within the process set
        self.dtype = dtype                # mpitrain.backends.dtypes.DType, or None
        self.shape = shape
        self.op = op
        self.prescale = prescale
        self.postscale = postscale
        self.root = root
        self.input = input
        self.output = output
        self.device = device              # -1: host memory; else a CUDA device
        self.ready = None                 # device inputs: an event after their producer
        self.splits = None
        self.site = site                  # where an unnamed call was made: "file:line"
        self.signature = signature(kind, -1 if dtype is None else dtype.code, shape,
                                   op, prescale, postscale, root, device, site)
        self.claimed = None               # (address read, address written), in flight
        self.enqueued = time.monotonic()
        self.state = QUEUED
        self.slot = None                  # the cache slot, while CACHED ...
        self.generation = -1              # ... as of this cache generation
        self.successor = None             # the same name, submitted again after a local error
        self.error = ""                   # a local argument error, sent to the other ranks
        self.error_kind = ""
        self.failed_locally = False       # the caller got its local error; this tells the others
        self.name_refused = False         # its name was no string (see Request)
        self.result = None                # set by the engine, visible once done
        self.error_raised = None
        self._done = False

    def request(self, now):
        """The record sent to the coordinator."""
        return Request(self.name, self.kind, self.rank,
                       -1 if self.dtype is None else self.dtype.code, self.shape,
                       self.op, self.prescale, self.postscale, self.root,
                       self.error, self.error_kind, now - self.enqueued, self.device,
                       self.site, self.name_refused)

    def done(self):
        return self._done

    def wait(self):
        if not self._done:
            with completed:
                while not self._done:
                    completed.wait()
        if self.error_raised is not None:
            raise self.error_raised
        return self.result

    def publish(self):
        """Make the result (or error) the engine set visible to waiters."""
        self.input = self.output = self.ready = None   # keep the caller's arrays no longer
        self._done = True

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
