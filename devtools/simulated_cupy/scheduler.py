"""When queued device work runs: only when something waits for it.

Every stream is a queue. Nothing runs when it is queued (a kernel launch, a
copy, a fill): work runs when a host thread waits for it (a stream's or an
event's synchronize, a copy to the host), and then only what that wait needs,
following ``wait_event`` dependencies into other streams. In random mode
each step of a wait runs the head of a stream drawn from all the runnable
ones, so other streams' work runs early and interleaved, as on a GPU.

Work that reads memory a host thread wrote too late, or that a stream should
have waited for, thus runs on stale or poisoned values and a test sees
them. Queued operations hold addresses and layouts, never arrays: a queue
does not keep a freed array's memory from being reused.

An operation that fails leaves the device unusable, as CUDA's sticky errors
do: every later call raises, naming the first failure.
"""

import collections
import random
import threading

from devtools.simulated_cupy.errors import SimulatedCudaError, caller


class _Op:
    __slots__ = ("label", "origin", "run", "touches")

    def __init__(self, label, origin, run, touches):
        self.label, self.origin, self.run = label, origin, run
        self.touches = touches       # [(address, bytes)] it reads or writes; None: unknown


class _Wait:
    __slots__ = ("stream", "position", "origin")

    def __init__(self, stream, position, origin):
        self.stream, self.position, self.origin = stream, position, origin


class _DeviceJob:
    """Work a device thread carries out (NCCL's collectives): the stream
    passes it once the job says it is done."""

    __slots__ = ("label", "origin", "done", "error", "touches")

    def __init__(self, label, origin):
        self.label, self.origin = label, origin
        self.done = False
        self.error = None
        self.touches = None


class Queue:
    """A stream's queued work; positions count every entry ever queued."""

    def __init__(self, name):
        self.name = name
        self.pending = collections.deque()
        self.queued = 0            # entries queued so far
        self.ran = 0               # entries run so far


class Scheduler:
    def __init__(self, seed, rank):
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.random = None if seed is None else random.Random(f"{seed}:{rank}")
        self.busy = {}             # id -> Queue with work queued
        self.broken = None         # the first failure, once there is one
        self.closed = False        # the process is exiting: frees do nothing
        self._when_idle = []

    def check(self):
        if self.broken is not None:
            raise SimulatedCudaError(f"the simulated GPU is unusable since an earlier "
                                     f"error (sticky, as on a GPU): {self.broken}")

    def fail(self, why):
        """Leave the device unusable, saying why; raise AttributeError now (for
        a reader, such as mpi4py, that asks for an attribute and moves on)."""
        with self.lock:
            if self.broken is None:
                self.broken = why
                self.changed.notify_all()
        raise AttributeError(why)

    # -- queueing -----------------------------------------------------------------

    def enqueue(self, queue, label, run, touches, origin=None):
        """Queue ``run`` (a function of nothing) on ``queue``; its position."""
        return self._append(queue, _Op(label, origin or caller(), run, touches))

    def enqueue_wait(self, queue, other, position):
        """``queue`` runs nothing more until ``other`` has run ``position`` entries."""
        if other is not queue and other.ran < position:
            self._append(queue, _Wait(other, position, caller()))

    def enqueue_job(self, queue, label):
        """A _DeviceJob on ``queue``, and the position the job must wait for."""
        job = _DeviceJob(label, caller())
        position = queue.queued
        self._append(queue, job)
        return job, position

    def _append(self, queue, entry):
        with self.lock:
            self.check()
            queue.pending.append(entry)
            queue.queued += 1
            self.busy[id(queue)] = queue
            return queue.queued

    def finish_job(self, job, error=None):
        with self.lock:
            job.done, job.error = True, error
            self.changed.notify_all()

    # -- running ------------------------------------------------------------------

    def wait_for(self, queue, position):
        """Run what ``queue``'s first ``position`` entries need, and them."""
        with self.lock:
            while queue.ran < position:
                self.check()
                if not self._step(queue):
                    self.changed.wait()
            self._maybe_idle()

    def progress(self, queue, position):
        """One step toward ``position`` without blocking (an event's query)."""
        with self.lock:
            self.check()
            if queue.ran < position:
                self._step(queue)
            return queue.ran >= position

    def run_everything(self):
        with self.lock:
            while self.busy:
                queue = next(iter(self.busy.values()))
                self.wait_for(queue, queue.queued)

    def when_idle(self, callback):
        """Call ``callback`` once no stream has work queued."""
        with self.lock:
            self._when_idle.append(callback)
            self._maybe_idle()

    def _maybe_idle(self):
        if not self.busy and self._when_idle:
            callbacks, self._when_idle = self._when_idle, []
            for callback in callbacks:
                callback()

    def pending_touch(self, address, nbytes):
        """The first queued operation that may touch [address, address + nbytes)."""
        with self.lock:
            for queue in self.busy.values():
                for entry in queue.pending:
                    if isinstance(entry, _Wait):
                        continue
                    if entry.touches is None or any(
                            start < address + nbytes and address < start + size
                            for start, size in entry.touches):
                        return f"{entry.label} queued at {entry.origin} on {queue.name}"
        return None

    def _runnable(self, queue):
        head = queue.pending[0]
        if isinstance(head, _Wait):
            return head.stream.ran >= head.position
        if isinstance(head, _DeviceJob):
            return head.done
        return True

    def _blocker(self, queue):
        """The queue whose head must run next for ``queue`` to move; None while
        that head is a device job still in progress."""
        while True:
            head = queue.pending[0]
            if isinstance(head, _Wait) and head.stream.ran < head.position:
                queue = head.stream
            elif isinstance(head, _DeviceJob) and not head.done:
                return None
            else:
                return queue

    def _step(self, target):
        """Run one entry: the one ``target`` needs next, or in random mode any
        runnable one. False where nothing can run until a device job ends."""
        chosen = self._blocker(target)
        if self.random is not None:
            runnable = [queue for queue in self.busy.values() if self._runnable(queue)]
            if runnable:
                chosen = self.random.choice(runnable)
        if chosen is None:
            return False
        self._run_head(chosen)
        return True

    def _run_head(self, queue):
        entry = queue.pending[0]
        try:
            if isinstance(entry, _Op):
                entry.run()
            elif isinstance(entry, _DeviceJob) and entry.error is not None:
                raise entry.error
        except Exception as error:
            self.broken = (f"{entry.label}, queued at {entry.origin} on {queue.name}, "
                           f"failed: {type(error).__name__}: {error}")
            self.changed.notify_all()
            raise SimulatedCudaError(self.broken) from error
        queue.pending.popleft()
        queue.ran += 1
        if not queue.pending:
            del self.busy[id(queue)]
        self.changed.notify_all()
