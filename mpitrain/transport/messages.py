"""Point-to-point messages between two ranks of a process set, on MPI, from any thread.

torch.distributed's send and recv (and their non-blocking forms) move one
buffer from one rank to another, started from whichever thread torch runs
them on. They use a process set's own pair of communicators, never the
ones mpitrain's engine thread runs collectives on (``Engine.add_set`` makes
them beside the set's, on the thread that makes that one): MPI, started
with MPI_THREAD_MULTIPLE, allows such calls from any thread.

A message is a header, then its payload. The header travels on the first
communicator with the caller's tag: the payload's size, what the sender
says it holds (``description``: a dtype and shape, compared by the
receiver) and the message's number among the sender's messages to that
rank. The payload travels on the second communicator, in pieces of at most
``PIECE`` bytes (MPI counts stop at 2**31 - 1), with that number as its tag.
So a receive from any source, or two receives from one rank with one tag,
each find their own payload whatever order their headers were matched in:
with payload and header on one tag, a second receive could match the
first one's payload as its header.

One progress thread per process tests every message in flight, with pauses
that grow while nothing moves (a tenth of the time since something did): it completes messages no one waits on, and
it makes the MPI calls that move a send's data while its sender computes.
"""

import threading
import time

import numpy as np
from mpi4py import MPI

from mpitrain.transport.channel import PIECE

HEADER_BYTES = 4096          # room for the size, the number and a description
_PAUSE_MIN = 20e-6           # seconds between tests of the messages in flight ...
_PAUSE_MAX = 20e-3           # ... growing while nothing moves, up to this


def largest_tag():
    return MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)


class Pair:
    """A process set's two communicators for messages, and its sends' numbers."""

    def __init__(self, comm):
        self.headers, self.payloads = comm.Dup(), comm.Dup()
        self._numbers = {}            # destination -> the number of its next message
        self._lock = threading.Lock()

    def next_number(self, dest):
        with self._lock:
            number = self._numbers.get(dest, 0)
            self._numbers[dest] = (number + 1) % (largest_tag() + 1)
        return number

    def free(self):
        self.headers.Free()
        self.payloads.Free()


class _Message:
    """One send or receive in flight; ``done(error, source)`` is called once."""

    def __init__(self, done, timeout, call):
        self.done, self.timeout, self.call = done, timeout, call
        self.deadline = time.monotonic() + timeout
        self.reported = False

    def finish(self, error=None, source=None):
        if not self.reported:
            self.reported = True
            self.done(error, source)


class Send(_Message):
    """``payload`` (a 1-D uint8 array, kept alive until sent) to ``dest``."""

    def __init__(self, pair, payload, description, dest, tag, done, timeout, call):
        super().__init__(done, timeout, call)
        number = pair.next_number(dest)
        self.header = np.frombuffer(f"{payload.size}|{number}|{description}"
                                    .encode()[:HEADER_BYTES], dtype=np.uint8)
        self.payload = payload
        self.requests = [pair.headers.Isend([self.header, MPI.BYTE], dest, tag)]
        self.requests += [pair.payloads.Isend([piece, MPI.BYTE], dest, number)
                          for piece in _pieces(payload)]

    def advance(self):
        """(finished, moved): sent; or, past the deadline, reported failed."""
        if MPI.Request.Testall(self.requests):
            self.finish()
            return True, True
        if time.monotonic() > self.deadline:     # kept in flight: a late recv still gets it
            self.finish(TimeoutError(f"{self.call}: no rank received it within "
                                     f"its timeout of {self.timeout:g} s"))
        return False, False


class Receive(_Message):
    """Into ``payload`` (a 1-D uint8 array) from ``source`` (None: any rank)."""

    def __init__(self, pair, payload, description, source, tag, done, timeout, call):
        super().__init__(done, timeout, call)
        self.pair, self.payload, self.description = pair, payload, description
        self.header = np.empty(HEADER_BYTES, dtype=np.uint8)
        self.status = MPI.Status()
        self.request = pair.headers.Irecv([self.header, MPI.BYTE],
                                          MPI.ANY_SOURCE if source is None else source, tag)
        self.pieces = None            # what is left to receive, once the header came
        self.source = self.number = self.error = None

    def advance(self):
        """(finished, moved): one step further, each time its request completes."""
        if not self.request.Test(self.status):
            if self.pieces is not None or time.monotonic() <= self.deadline:
                return False, False
            if self._cancelled():
                self.finish(TimeoutError(f"{self.call}: nothing arrived within its "
                                         f"timeout of {self.timeout:g} s"))
                return True, True
        if self.pieces is None:
            self._read_header()
        if not self.pieces:
            self.finish(self.error, self.source)
            return True, True
        piece = self.pieces.pop(0)
        self.request = self.pair.payloads.Irecv([piece, MPI.BYTE], self.source, self.number)
        return False, True

    def _read_header(self):
        self.source = self.status.Get_source()
        header = bytes(self.header[:self.status.Get_count(MPI.BYTE)])
        size, number, sent = header.decode(errors="replace").split("|", 2)
        self.number = int(number)
        if sent == self.description and int(size) == self.payload.size:
            self.pieces = _pieces(self.payload)
            return
        self.error = ValueError(f"{self.call}: rank {self.source} sent {sent}, this rank "
                                f"receives into {self.description}")
        # drain what was sent, so that the sender's send completes
        scratch = np.empty(min(int(size), PIECE), dtype=np.uint8)
        self.pieces = [scratch[:len(piece)] for piece in _pieces(range(int(size)))]

    def _cancelled(self):
        """Cancel the header's receive; False where a header came meanwhile."""
        self.request.Cancel()
        self.request.Wait(self.status)
        return self.status.Is_cancelled()


def _pieces(sequence):
    return [sequence[i:i + PIECE] for i in range(0, len(sequence), PIECE)] or [sequence]


class Progress:
    """The thread that tests every message in flight until it completes."""

    def __init__(self):
        self._messages = []
        self._wake = threading.Condition()
        self._thread = None
        self._added = False

    def add(self, message):
        with self._wake:
            self._messages.append(message)
            self._added = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="mpitrain-messages")
                self._thread.start()
            self._wake.notify()

    def _run(self):
        moved_at = time.monotonic()
        while True:
            with self._wake:
                while not self._messages:
                    self._wake.wait()
                messages = list(self._messages)
            moved_any = False
            for message in messages:
                try:
                    finished, moved = message.advance()
                except Exception as error:       # an MPI error ends this message only
                    message.finish(error)
                    finished, moved = True, True
                moved_any |= moved
                if finished:
                    with self._wake:
                        self._messages.remove(message)
            with self._wake:
                if moved_any or self._added:
                    self._added, moved_at = False, time.monotonic()
                    continue
                # a tenth of the time nothing moved: a completion is seen at
                # most ~10% late, and a long wait costs few wake-ups
                waited = time.monotonic() - moved_at
                self._wake.wait(min(_PAUSE_MAX, max(_PAUSE_MIN, 0.1 * waited)))
