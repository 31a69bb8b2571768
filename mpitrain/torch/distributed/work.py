"""Work objects of the "mpitrain" backend: an mpitrain handle seen as a torch future.

torch's tools wait on a collective in two ways: ``work.wait()``, and the
future of ``work.get_future()`` that DDP's communication hooks and FSDP2
chain callbacks on. A torch future completes only when someone sets it, so
one thread per process (the completer) waits on the handles in the order
they were submitted and, after ``finish`` has written the result where torch
wants it (the output tensors), has a pool thread set each future. Setting a
future runs its callbacks, and a callback may start another collective and
wait for it (PowerSGD's hook does): on the completer's own thread that wait
would never end, and the pool grows a thread whenever all of its are busy. Work objects are torch's
own wrapping of such a future (``_create_work_from_future``): ``wait()``,
``is_completed()``, ``get_future()`` and ``exception()`` behave as torch's.
"""

import concurrent.futures
import queue
import threading

import torch
from torch._C._distributed_c10d import _create_work_from_future

from mpitrain.api.handles import synchronize
from mpitrain.torch.distributed.naming import callbacks_of


class _Completer:
    """The one thread that turns finished handles into completed futures."""

    def __init__(self):
        self._pending = queue.SimpleQueue()
        self._setters = concurrent.futures.ThreadPoolExecutor(
            max_workers=64, thread_name_prefix="mpitrain-torch-distributed-callbacks")
        self._thread = None
        self._lock = threading.Lock()

    def add(self, name, handle, finish, future):
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="mpitrain-torch-distributed")
                self._thread.start()
        self._pending.put((name, handle, finish, future))

    def _run(self):
        while True:
            name, handle, finish, future = self._pending.get()
            try:
                value = finish(synchronize(handle))
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


def pending_work(name, handle, finish, result_tensors):
    """A Work that completes once ``handle`` (of call ``name``) has and
    ``finish(its result)`` ran.

    The future's value is ``result_tensors``, a list, as torch's own
    backends give it (DDP's hooks read ``fut.value()[0]``).
    """
    future = torch.futures.Future(devices=_devices(result_tensors))
    _completer.add(name, handle, lambda result: (finish(result), result_tensors)[1], future)
    return _create_work_from_future(future)


def completed_work(result_tensors):
    """A Work that is already complete (a call with nothing to move)."""
    future = torch.futures.Future(devices=_devices(result_tensors))
    future.set_result(result_tensors)
    return _create_work_from_future(future)


def work_of(future):
    """A Work that completes with ``future``."""
    return _create_work_from_future(future)
