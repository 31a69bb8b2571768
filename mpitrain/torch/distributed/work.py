"""Work objects of the "mpitrain" backend: an mpitrain handle seen as a torch future.

torch's tools wait on a collective in two ways: ``work.wait()``, and the
future of ``work.get_future()`` that DDP's communication hooks and FSDP2
chain callbacks on. A torch future completes only when someone sets it, so
one thread per process (the completer) waits on the handles in the order
they were submitted and, after ``finish`` has written the result where torch
wants it (the output tensors), has a pool thread set each future. Setting a
future runs its callbacks, and a callback may start another collective and
wait for it (PowerSGD's hook does): on the completer's own thread that wait
would never end, and the pool grows a thread whenever all of its are busy.
Work objects (MpitrainWork) answer ``wait()``, ``is_completed()``,
``get_future()`` and ``exception()`` as torch's own do.
"""

import concurrent.futures
import queue
import threading

import torch
import torch.distributed as dist

from mpitrain.torch.distributed.naming import callbacks_of


class _Completer:
    """The one thread that turns finished handles into completed futures."""

    def __init__(self):
        self._pending = queue.SimpleQueue()
        self._setters = concurrent.futures.ThreadPoolExecutor(
            max_workers=64, thread_name_prefix="mpitrain-torch-distributed-callbacks")
        self._thread = None
        self._lock = threading.Lock()

    def add(self, name, complete, future):
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="mpitrain-torch-distributed")
                self._thread.start()
        self._pending.put((name, complete, future))

    def _run(self):
        while True:
            name, complete, future = self._pending.get()
            try:
                value = complete()
            except BaseException as error:    # every error reaches the waiter
                self._set(name, future.set_exception, error)
            else:
                self._set(name, future.set_result, value)

    def _set(self, name, setter, value):
        try:
            self._setters.submit(_run_callbacks, name, setter, value)
        except RuntimeError:       # the interpreter is exiting: no new pool threads
            setter(value)


def _run_callbacks(name, setter, value):
    with callbacks_of(name):
        setter(value)


_completer = _Completer()


def _devices(tensors):
    """The CUDA devices a future's value lives on (torch checks them)."""
    return sorted({t.device for t in tensors if t.device.type == "cuda"},
                  key=str) or None


class MpitrainWork(dist.Work):
    """A call in flight: ``wait()`` raises the call's own error (a MismatchError
    naming the ranks, say); ``get_future()`` is a future that torch's C++ side
    (DDP's reducer) sees fail too, as a callback raising fails the future
    ``then`` made (a Python future's set_exception only stores the exception
    as its value)."""

    def __init__(self, source):
        super().__init__()
        self._source = source
        self._future = source.then(_value)

    def wait(self, timeout=None):
        self._source.wait()
        # The future's own callback runs on the thread that set the source,
        # maybe after this thread woke: wait() means get_future() is done too.
        self._future.wait()
        return True

    def is_completed(self):
        return self._source.done()

    def is_success(self):
        return self._future.done() and self.exception() is None

    def exception(self):
        if not self._source.done():
            return None
        try:
            self._source.value()
        except Exception as error:
            return error
        return None

    def get_future(self):
        return self._future


def _value(source):
    return source.value()


def pending_work(name, complete, result_tensors):
    """A Work that completes once ``complete()`` (which waits for call ``name``
    and puts its result in place) has returned, or fails with its error.

    The future's value is ``result_tensors``, a list, as torch's own
    backends give it (DDP's hooks read ``fut.value()[0]``).
    """
    source = torch.futures.Future(devices=_devices(result_tensors))
    _completer.add(name, lambda: (complete(), result_tensors)[1], source)
    return MpitrainWork(source)


def completed_work(result_tensors):
    """A Work that is already complete (a call with nothing to move)."""
    source = torch.futures.Future(devices=_devices(result_tensors))
    source.set_result(result_tensors)
    return MpitrainWork(source)
