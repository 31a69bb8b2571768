"""The engine's watch: a thread that stops this rank's engine when MPI cannot.

Two things leave a rank's engine inside MPI for good, where none of the
engine thread's Python code runs: a peer that stops answering during a
blocking call (frozen, or lost), and a peer whose engine failed and will
never join the collective the others are in. The watch, a thread that
sleeps between looks, sees both:

- every blocking MPI call of the engine runs inside ``call()``; one that
  has not returned after the stall shutdown time stops this rank's engine,
  with a report naming the call, the operation and the ranks to blame;
- a rank whose engine fails tells every other rank, on a communicator of
  its own, and their watches stop their engines with that reason at once.

Before blaming a peer, a waiting rank asks it: every watch answers a ping
with how long its engine has waited on MPI without progress (nothing while
it works) and in which blocking call. A peer that does not answer is frozen
or gone; one that works, moves data, or waits in the same call is busy with
a long, healthy transfer, and the wait goes on. One that has waited as long
inside another blocking call never will: the two calls wait for each other
(the ranks chose different calls). The engine thread, when stuck inside
MPI, is abandoned: it sees the stop when (if ever) its call returns.
"""

import contextlib
import logging
import threading
import time

import numpy as np
from mpi4py import MPI

from mpitrain.engine.controller import EngineStopped
from mpitrain.transport.channel import ROUND

log = logging.getLogger("mpitrain")

NOTICE, PING, PONG = 1, 2, 3   # message tags; a pong goes back on PONG + the asker
WATCH, ENGINE = 0, 1           # who asks: the watch thread or the engine thread
NOTICE_BYTES = 4096            # a notice fits MPI's eager protocol: sending never waits
LOOK_EVERY = 0.5               # seconds between the watch's looks
ANSWER_WITHIN = 2.0            # seconds a live peer's watch takes at most to answer
CALL_BYTES = 256               # of the blocking call's name in an answer
ANSWER_WORDS = 3 + CALL_BYTES // 8     # (question, waited, transferring) and the call


class EngineAbandoned(Exception):
    """Raised in the engine thread when it comes back from MPI after the watch
    stopped the engine for it."""


class Watch:
    def __init__(self, engine, comm, limit, threads_multiple):
        self.engine = engine
        self.limit = limit             # seconds without progress; 0: wait forever
        self.rank = comm.rank
        self.working = False           # the engine thread runs code, not waiting on MPI
        self.reason = ""               # why the watch stopped the engine
        self.abandoned = False         # ... while its thread was inside MPI
        self._lock = threading.Lock()
        self._inside = None            # the blocking call the engine thread is in
        self._since = 0.0              # ... since when
        self._patient_from = 0.0       # the watch last found that wait healthy
        self._sent = []                # sends not known to be done, kept alive
        self._sent_lock = threading.Lock()
        self._question = 0             # numbers questions, so a late answer is known
        self._wake = threading.Event()
        # Receiving on this thread while the engine thread is inside MPI
        # needs MPI_THREAD_MULTIPLE; without it the watch only times calls.
        self._comm = comm.Dup() if threads_multiple else None     # collective, at init
        self._notice = np.empty(NOTICE_BYTES, dtype=np.uint8)
        self._ping = np.empty(2, dtype=np.float64)      # (asker, question)
        self._receiving = {}
        if self._comm is not None:
            self._listen(NOTICE)
            self._listen(PING)
        self._thread = threading.Thread(target=self._run, name="mpitrain-watch",
                                        daemon=True)

    def start(self):
        self._thread.start()

    # -- called by the engine thread ---------------------------------------

    @contextlib.contextmanager
    def call(self, what):
        """Wrap one blocking MPI call of the engine thread."""
        with self._lock:
            if self.reason:
                raise EngineStopped(self.reason)
            self._inside, self._since = what, time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._inside = None
                if self.abandoned:
                    raise EngineAbandoned()

    def tell_others(self, reason):
        """This rank's engine failed: let every other rank know, without waiting."""
        data = np.frombuffer(reason.encode()[:NOTICE_BYTES], dtype=np.uint8)
        self._to_everyone(data, NOTICE)

    def blame(self, ranks, asker=ENGINE, transfers_only=False):
        """Why ``ranks`` keep this rank waiting, or "" where one of them is
        busy moving data (then the wait is healthy and goes on).
        transfers_only: count only ranks inside a collective's transfer as
        moving, not those that negotiate or have nothing in flight."""
        if self._comm is None:
            return "another rank's mpitrain engine stopped answering (is its process " \
                   "frozen, or was it killed?)"
        with self._lock:
            mine = self._inside
        answers = self._ask(ranks, asker)
        ages = {rank: age for rank, (age, _, _) in answers.items()}
        silent = [rank for rank in ranks if rank not in ages]
        elsewhere = {rank: (age, call) for rank, (age, _, call) in answers.items()
                     if mine and call and call != mine and age >= self.limit}
        moving = [rank for rank, (age, transferring, call) in answers.items()
                  if rank not in elsewhere and (
                      (mine and call == mine)
                      or (age < self.limit and (transferring or not transfers_only)))]
        if moving and not silent and not elsewhere:
            return ""
        parts = []
        if silent:
            parts.append(f"{_ranks(silent)} did not answer within {ANSWER_WITHIN:g} s "
                         "(is the process frozen, or was it killed?)")
        calls = {}
        for rank, (_, call) in sorted(elsewhere.items()):
            calls.setdefault(call, []).append(rank)
        for call, inside in calls.items():
            parts.append(f"{_ranks(inside)} answered from inside another MPI call, "
                         f"{call}, where {'it has' if len(inside) == 1 else 'they have'} "
                         f"waited {max(elsewhere[r][0] for r in inside):.0f} s")
        if calls:
            parts[-1] += (": the ranks made different MPI calls, which wait for each "
                          "other forever (a choice that differed between ranks)")
        still = sorted(set(ages) - set(moving) - set(elsewhere))
        if still:
            parts.append(f"{_ranks(still)} answered, but {_its(still)} mpitrain "
                         f"engine has waited {max(ages[r] for r in still):.0f} s too")
        return "; ".join(parts)

    # -- the watch thread -----------------------------------------------------

    def stop(self):
        """End the watch; its thread cancels the receives it had posted."""
        self._wake.set()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(LOOK_EVERY + 2 * ANSWER_WITHIN)

    def free(self):
        """Free the watch's communicator: at a shutdown every rank agreed to."""
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def _run(self):
        try:
            self._look()
        finally:
            if not self.abandoned:         # else MPI may be broken: leave it be
                for request in self._receiving.values():
                    request.Cancel()
                    request.Wait()
            self._receiving = {}

    def _look(self):
        while not self._wake.wait(LOOK_EVERY):
            if self.engine.stopped:
                return
            self._answer_pings()
            status = MPI.Status()
            if NOTICE in self._receiving and self._receiving[NOTICE].Test(status):
                del self._receiving[NOTICE]
                source = status.Get_source()
                reason = bytes(self._notice[:status.Get_count(MPI.BYTE)]).decode(
                    errors="replace")
                self._fire(f"rank {source}'s mpitrain engine failed, so rank "
                           f"{self.rank}'s stopped too. Rank {source}: {reason}")
                return
            with self._lock:
                what, since = self._inside, self._since
            if what is None or not self.limit or \
                    time.monotonic() - max(since, self._patient_from) < self.limit:
                continue
            others = [rank for rank in range(self.engine.topology.size) if rank != self.rank]
            blame = self.blame(others, WATCH)
            if not blame:                 # a long healthy transfer: wait on
                # Only this watch's patience starts again: peers asking this
                # rank still learn how long it has waited in this call.
                self._patient_from = time.monotonic()
                continue
            self._fire(f"rank {self.rank} waited {time.monotonic() - since:.0f} s inside "
                       f"{what}, which moved no data meanwhile: {blame}")
            return

    def _fire(self, reason):
        """Stop the engine: for its thread where that is stuck inside MPI, else
        by asking it to stop at its next look."""
        with self._lock:
            self.reason = reason           # call() lets no further MPI call start
            self.abandoned = self._inside is not None
        log.error("mpitrain: %s", reason)
        if self.abandoned:
            self.engine.finish_for_stuck_thread(reason)
        else:
            self.engine.request_failure(reason)

    # -- messages ---------------------------------------------------------------

    def _listen(self, tag):
        buffer = [self._notice, MPI.BYTE] if tag == NOTICE else self._ping
        self._receiving[tag] = self._comm.Irecv(buffer, MPI.ANY_SOURCE, tag)

    def _answer_pings(self):
        """Tell each rank that asked how long ago this engine last moved."""
        if PING not in self._receiving:
            return
        status = MPI.Status()
        while self._receiving[PING].Test(status):
            asker, question = self._ping
            waited, transferring, call = self._waited()
            answer = _answer(question, waited, transferring, call)
            self._keep(self._comm.Isend(answer, status.Get_source(), PONG + int(asker)))
            self._listen(PING)

    def _waited(self):
        """(how long this engine has waited on MPI without progress (0: it
        works), whether it is inside a collective's transfer (1.0) or not,
        the blocking call it is inside or "")."""
        now = time.monotonic()
        with self._lock:
            inside, since = self._inside, self._since
        busy = [c for c in self.engine.running() if c.coroutine is not None]
        transferring = float(any(c.channel.activity != ROUND for c in busy))
        if inside is not None:
            return now - since, float(not inside.endswith(ROUND)), inside
        if self.working:
            return 0.0, transferring, ""
        return (now - max(c.moved for c in busy) if busy else 0.0), transferring, ""

    def _ask(self, ranks, asker):
        """{rank: (seconds since its engine moved, inside a transfer, the
        blocking call it is inside or "")} of the ranks that answer in time."""
        with self._sent_lock:
            self._question += 1
            question = self._question
        for rank in ranks:
            self._keep(self._comm.Isend(np.array([asker, question], dtype=np.float64),
                                        rank, PING))
        answers = {rank: np.zeros(ANSWER_WORDS) for rank in ranks}
        pending = {rank: self._comm.Irecv(answers[rank], rank, PONG + asker)
                   for rank in ranks}
        deadline = time.monotonic() + ANSWER_WITHIN
        replies = {}
        while pending and time.monotonic() < deadline:
            if asker == WATCH:
                self._answer_pings()
            for rank in [r for r, request in pending.items() if request.Test()]:
                if answers[rank][0] == question:
                    replies[rank] = (float(answers[rank][1]), bool(answers[rank][2]),
                                     _call_in(answers[rank]))
                    del pending[rank]
                else:                     # the late answer to an earlier question
                    pending[rank] = self._comm.Irecv(answers[rank], rank, PONG + asker)
            time.sleep(0.01)
        for request in pending.values():
            request.Cancel()
            request.Wait()
        return replies

    def _to_everyone(self, data, tag):
        if self._comm is None:
            return
        for rank in range(self._comm.size):
            if rank != self.rank:
                try:
                    self._keep(self._comm.Isend([data, MPI.BYTE], rank, tag))
                except MPI.Exception as error:     # MPI itself may be what failed
                    log.error("mpitrain: could not tell rank %d: %s", rank, error)

    def _keep(self, request):
        """Hold a send until it is done (mpi4py must not free it before)."""
        with self._sent_lock:
            self._sent = [r for r in self._sent if not r.Test()] + [request]


def _answer(question, waited, transferring, call):
    """A pong: three numbers, then the name of the call in CALL_BYTES bytes."""
    answer = np.zeros(ANSWER_WORDS)
    answer[:3] = question, waited, transferring
    name = call.encode()[:CALL_BYTES]
    answer[3:].view(np.uint8)[:len(name)] = np.frombuffer(name, np.uint8)
    return answer


def _call_in(answer):
    return bytes(answer[3:].view(np.uint8)).rstrip(b"\0").decode(errors="replace")


def _ranks(ranks):
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else "ranks " + ", ".join(map(str, ranks)))


def _its(ranks):
    return "its" if len(ranks) == 1 else "their"
