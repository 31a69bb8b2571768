"""cupy.cuda's Device, Stream and Event over the scheduler, and each thread's
current device and stream (per thread, as CuPy keeps them)."""

import itertools
import threading
import weakref

from devtools.simulated_cupy import simulation
from devtools.simulated_cupy.errors import runtime_error
from devtools.simulated_cupy.scheduler import Queue

_local = threading.local()
_handles = itertools.count(0x5000)            # fake CUDA handles, never 0
_by_ptr = weakref.WeakValueDictionary()       # stream handle -> Stream


def current_device():
    return getattr(_local, "device", 0)


def current_stream():
    stack = _streams().get(current_device())
    return stack[-1] if stack else Stream.null


def _streams():
    if not hasattr(_local, "streams"):
        _local.streams = {}
    return _local.streams


def stream_of(ptr):
    """The Stream whose handle is ``ptr`` (0: the null stream)."""
    if ptr == 0:
        return Stream.null
    stream = _by_ptr.get(ptr)
    if stream is None:
        raise runtime_error(400, f"{ptr:#x} is no stream of the simulated device")
    return stream


class Device:
    """A CUDA device: a context manager that makes it current, ``use()``, ``id``."""

    def __init__(self, device=None):
        self.id = current_device() if device is None else int(device)
        simulation.state().check_device(self.id)
        self._previous = []

    def __enter__(self):
        self._previous.append(current_device())
        _local.device = self.id
        return self

    def __exit__(self, *exc):
        _local.device = self._previous.pop()

    def use(self):
        _local.device = self.id

    def synchronize(self):
        simulation.state().scheduler.run_everything()

    @property
    def pci_bus_id(self):
        return simulation.state().bus_id(self.id)

    @property
    def compute_capability(self):
        return "90"

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __repr__(self):
        return f"<CUDA Device {self.id} (simulated)>"


class Stream:
    """A queue of device work; ``with stream:`` makes it current in this thread."""

    null = None          # set below: the legacy default stream

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else next(_handles)
        self.device_id = current_device()
        self._queue = Queue("the null stream" if null else f"stream {self.ptr:#x}")
        if not null:
            _by_ptr[self.ptr] = self

    def __enter__(self):
        _streams().setdefault(current_device(), []).append(self)
        return self

    def __exit__(self, *exc):
        _streams()[current_device()].pop()

    def use(self):
        stack = _streams().setdefault(current_device(), [])
        stack[:] = [self]
        return self

    def synchronize(self):
        simulation.state().scheduler.wait_for(self._queue, self._queue.queued)

    def wait_event(self, event):
        if event._queue is not None:
            simulation.state().scheduler.enqueue_wait(self._queue, event._queue,
                                                      event._position)

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    @property
    def done(self):
        return simulation.state().scheduler.progress(self._queue, self._queue.queued)

    def __repr__(self):
        return f"<simulated {self._queue.name}>"


Stream.null = Stream(null=True)


class Event:
    """A point in a stream's queue; ``synchronize()`` runs the stream up to it."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.ptr = next(_handles)
        self._queue = None           # where it was last recorded
        self._position = 0

    def record(self, stream=None):
        stream = current_stream() if stream is None else stream
        with simulation.state().scheduler.lock:
            self._queue, self._position = stream._queue, stream._queue.queued

    def synchronize(self):
        if self._queue is not None:
            simulation.state().scheduler.wait_for(self._queue, self._position)

    @property
    def done(self):
        if self._queue is None:
            return True
        return simulation.state().scheduler.progress(self._queue, self._position)


def get_current_stream(device_id=-1):
    if device_id not in (-1, current_device()):
        with Device(device_id):
            return current_stream()
    return current_stream()
