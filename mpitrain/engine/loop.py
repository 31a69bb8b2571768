"""The engine: one background thread that makes every MPI call of mpitrain.

User and framework threads only enqueue entries and wait on handles. The
thread advances each process set's round as far as MPI lets it, then sleeps
until a round is due, a request may have completed, or new work arrives: it
never spins while it waits.
"""

import logging
import threading
import time
import traceback

from mpi4py import MPI

from mpitrain.engine import submission
from mpitrain.engine.controller import EngineLinks, EngineStopped, SetController
from mpitrain.engine.handles import notify_waiters
from mpitrain.engine.timeline import Timeline
from mpitrain.engine.watch import EngineAbandoned, Watch
from mpitrain.errors import ShutdownError
from mpitrain.ops import OpType

log = logging.getLogger("mpitrain")

_POLL_MIN = 50e-6     # seconds between tests of a pending MPI request ...
_POLL_MAX = 10e-3     # ... growing with the wait, to stay within ~10% of it
STOP_TIMEOUT = 30.0   # how long shutdown() waits for the other ranks to agree


class TimelineHolder:
    """The timeline in use, replaced at run time by start/stop_timeline."""

    def __init__(self):
        self.current = None


class Engine:
    def __init__(self, topology, config, cuda_aware, device_plan, host_route):
        self.topology = topology
        self.config = config
        self.host_route = host_route          # the job-wide set's host allreduces
        self.cuda_aware = cuda_aware          # MPI reads device memory on this rank
        self.device_plan = device_plan        # mpitrain.transport.selection.Plan, job-wide
        self._mutex = threading.Lock()      # entered directly on the hot path
        self.lock = threading.Condition(self._mutex)
        self.timeline = TimelineHolder()
        self.controllers = {}          # process set id -> SetController (member sets)
        self.retiring = []             # removed sets' controllers, until their last round
        self.set_ranks = {}            # process set id -> ranks, for every registered set
        self.stop_requested = False
        self.stop_reason = None        # why this rank asked to stop
        self.stopped = False
        self.stopped_reason = None     # why the engine stopped, as users see it
        self.clean_stop = False        # every rank agreed to stop
        self._failure = ""             # why the watch asked the engine thread to stop
        self.watch = Watch(self, topology.comm, config.stall_shutdown_time,
                           topology.threads_multiple)
        self._sleeping = False
        self._thread = threading.Thread(target=self._run, name="mpitrain-engine",
                                        daemon=True)
        self._links = EngineLinks(
            lock=self.lock, timeline=self.timeline, watch=self.watch, config=config,
            host_route=host_route, device_plan=device_plan, node=topology.node,
            job_rank=topology.rank, stop_requested=lambda: self.stop_requested,
            agree_to_stop=self.agree_to_stop, request_stop=self.request_stop,
            change_process_sets=self.change_process_sets)

    # -- set-up, from the thread that calls init() ----------------------------

    def add_set(self, set_id, ranks, comm):
        """Register a process set; comm is None where this rank is not a member."""
        controller = (None if comm is None else
                      SetController(self._links, set_id, ranks, comm,
                                    blocking=(set_id == 0)))
        with self.lock:
            self.set_ranks[set_id] = tuple(ranks)
            if controller is not None:
                self.controllers[set_id] = controller

    def start(self):
        path = self.config.timeline
        if path and path.upper() != "DYNAMIC" and self.topology.rank == 0:
            # Only rank 0 writes it: failing init there alone would strand the others.
            try:
                self.timeline.current = Timeline(path, self.config.timeline_mark_cycles)
            except OSError as error:
                log.warning("no timeline: %s; the job runs without one", error)
        self.watch.start()
        self._thread.start()

    # -- called by user threads ------------------------------------------------

    def enqueue(self, controller, entry):
        """Hand one handle to the engine (the hot path of every async call).

        Returns why its arrays may not be used now (see
        mpitrain.engine.execution.claims), or None. Such an entry still goes,
        carrying that error, so that the other ranks fail its name too.
        """
        with self._mutex:
            if self.stopped:
                raise ShutdownError(self.stopped_reason)
            if controller.removed:
                raise _removed(controller)
            conflict = submission.accept(controller, entry)
            if self._sleeping:
                self._sleeping = False       # one wake-up is enough for a burst
                self.lock.notify()
        return conflict

    def enqueue_many(self, controller, entries):
        """Hand entries to the engine at once, so one round sees them all
        (submission.accept_many says what may fail)."""
        with self.lock:
            if self.stopped:
                raise ShutdownError(self.stopped_reason)
            if controller.removed:
                raise _removed(controller)
            conflict = submission.accept_many(controller, entries)
            if self._sleeping:
                self._sleeping = False
                self.lock.notify()
        return conflict

    def controller_for(self, set_id):
        """This rank's controller of a set, or None where it is not a member."""
        if self.stopped:
            raise ShutdownError(self.stopped_reason)
        return self.controllers.get(set_id)     # changed only under self.lock

    def running(self):
        """The controllers whose rounds the engine thread advances."""
        return list(self.controllers.values()) + self.retiring

    def request_stop(self, reason):
        with self.lock:
            if not self.stop_requested:
                self.stop_requested = True
                self.stop_reason = reason
            self._sleeping = False
            self.lock.notify()

    def request_failure(self, reason):
        """From the watch: stop this rank's engine at its next look, with ``reason``."""
        with self.lock:
            self._failure = reason
            self._sleeping = False
            self.lock.notify()

    def finish_for_stuck_thread(self, reason):
        """From the watch: the engine thread is inside MPI for good; stop for it."""
        self._finish(reason)

    def stop(self, reason, timeout=STOP_TIMEOUT):
        """Ask every rank to stop and wait for the engine thread to end."""
        self.request_stop(reason)
        if self.watch.abandoned:           # its thread will not come back from MPI
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("mpitrain: the other ranks did not answer the shutdown "
                      "within %.0f s; stopping this rank's engine anyway", timeout)
            self._finish(f"rank {self.topology.rank}: {reason}; the other ranks "
                         "did not answer")

    def set_timeline(self, timeline):
        old, self.timeline.current = self.timeline.current, timeline
        if old is not None:
            old.close()

    # -- the engine thread -------------------------------------------------------

    def _run(self):
        reason = None
        try:
            while not self.stopped:
                if self._failure:
                    raise EngineStopped(self._failure)
                now = time.monotonic()
                self.watch.working = True
                for controller in self.running():
                    controller.advance(now)
                    self._check_responsive(controller, now)
                    if controller.retired and controller in self.retiring:
                        self.retiring.remove(controller)
                        controller.channel.comm.Free()
                self.watch.working = False
                timeline = self.timeline.current
                if timeline is not None:
                    timeline.flush()
                with self.lock:
                    delay = self._sleep_time(time.monotonic())
                    if delay > 0:
                        self._sleeping = True
                        self.lock.wait(delay)
                        self._sleeping = False
        except EngineAbandoned:         # back from MPI after the watch stopped for it
            return
        except EngineStopped as stop:
            reason = str(stop)
        except BaseException:
            reason = ("the mpitrain engine failed on rank "
                      f"{self.topology.rank}:\n{traceback.format_exc()}")
            log.error("%s", reason)
            self.watch.tell_others(reason)
        self._finish(reason)

    def _sleep_time(self, now):
        delay = float("inf")
        for controller in self.running():
            if controller.coroutine is not None:
                waited = now - controller.wait_started
                delay = min(delay, max(_POLL_MIN, min(_POLL_MAX, 0.1 * waited)))
            else:
                delay = min(delay, controller.next_start() - now)
        return delay

    def _check_responsive(self, controller, now):
        limit = self.config.stall_shutdown_time
        if controller.coroutine is None or not limit:
            return
        waited = now - controller.moved
        if waited <= limit:
            return
        me = self.topology.rank
        blame = self.watch.blame([rank for rank in controller.ranks if rank != me])
        if not blame:                  # a peer is busy moving data: wait on
            controller.moved = time.monotonic()
            return
        raise EngineStopped(
            f"rank {me} waited {waited:.0f} s in process set {controller.set_id}'s "
            f"{controller.channel.activity}, which moved no data meanwhile: {blame}")

    def agree_to_stop(self, channel):
        """Run on the job-wide round that saw a stop request: learn who and why."""
        reasons = yield from channel.allgather_objects(self.stop_reason)
        self.clean_stop = True
        parts = [f"rank {rank}: {reason}" for rank, reason in enumerate(reasons)
                 if reason]
        return "mpitrain has been shut down (" + "; ".join(parts) + ")"

    def _finish(self, reason):
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            self.stopped_reason = reason or "mpitrain has been shut down"
        error = ShutdownError(self.stopped_reason)
        for controller in self.running():
            controller.fail_all(lambda entry: error)
        notify_waiters()
        self.set_timeline(None)
        self.watch.stop()

    # -- process sets, executed by the job-wide controller in every rank's round --

    def change_process_sets(self, response):
        if response.kind == OpType.ADD_PROCESS_SET:
            ranks = list(response.extra)
            set_id = max(self.set_ranks) + 1
            self.add_set(set_id, ranks, create_communicator(self.topology.comm, ranks))
            return set_id
        set_id = response.extra[0]
        with self.lock:
            controller = self.controllers.pop(set_id, None)
            del self.set_ranks[set_id]
            if controller is not None:
                # Its round may be under way, its peers' too: it runs one
                # more, its last, before the communicator is freed. A peer's
                # flag may have ended it already, before this rank's removal.
                controller.removed = True
                if controller.retired:
                    controller.channel.comm.Free()
                else:
                    self.retiring.append(controller)
        return set_id


def _removed(controller):
    """A submission that raced with the removal of its set, from another thread."""
    return ValueError(f"{controller.rank_names.members} was removed by "
                      "remove_process_set; add a process set again to use its ranks")


def create_communicator(comm, ranks):
    """A communicator of ``ranks`` (collective over ``comm``); None for others."""
    group = comm.Get_group().Incl(ranks)
    try:
        created = comm.Create(group)
    finally:
        group.Free()
    return None if created == MPI.COMM_NULL else created
