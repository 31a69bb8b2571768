"""A rank's line to mpitrainrun in its elastic mode.

Every rank of an elastic job connects to the launcher once, when its first
elastic state is made, and says who it is. Through the line:

- the launcher tells rank 0 that hosts were added or removed, and rank 0
  tells every rank at the next commit (state.check_host_updates);
- rank 0 tells the launcher which commit it resumed from, and at which
  commit the job stops to take in new hosts;
- each rank says when it ends by an unhandled exception, or on its own
  (interpreter exit). A rank whose line closes without either was killed:
  the first to go that way is the lost one, whose host the launcher leaves
  out of the next start. MPI cannot say this: when one rank dies, a rank on
  another host often aborts first ("Socket closed") and Open MPI names that
  one.

A rank that cannot reach the launcher warns and trains on: the launcher
then knows a loss only from Open MPI's report (a rank killed by a signal),
and the job takes in new hosts only when it restarts.
"""

import atexit
import logging
import os
import socket
import sys
import threading

from mpitrain.runtime import elastic_job

log = logging.getLogger("mpitrain")


class Link:
    """This rank's connection to mpitrainrun."""

    def __init__(self, job, rank):
        self.rank = rank
        self.hosts_generation = 0       # the launcher's count of host changes
        self._pid = os.getpid()
        self._lock = threading.Lock()
        host, _, port = job.address.rpartition(":")
        self._socket = socket.create_connection((host, int(port)), timeout=30)
        self._socket.settimeout(None)
        # A forked data-loader worker must not hold the line open after this
        # rank dies, or its end would not show.
        os.register_at_fork(after_in_child=self._socket.close)
        self.send(token=job.token, restart=job.restarts, rank=rank,
                  host=socket.gethostname())
        if rank == 0:
            threading.Thread(target=self._listen, daemon=True,
                             name="mpitrain-elastic-launcher").start()
        self._report_exceptions()
        atexit.register(self.send, exit=True)

    def send(self, **message):
        """Send one message; the launcher being gone is no error of the rank's."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            try:
                self._socket.sendall(elastic_job.encode(message))
            except OSError:
                pass

    def _listen(self):
        with self._socket.makefile("rb") as lines:
            for line in lines:
                message = elastic_job.decode(line) or {}
                if isinstance(message.get("hosts_updated"), int):
                    self.hosts_generation = message["hosts_updated"]

    def _report_exceptions(self):
        """Wrap the exception hooks (mpitrain's abort among them), so that the
        launcher hears of the exception before the abort ends the job."""
        previous, previous_in_thread = sys.excepthook, threading.excepthook

        def hook(kind, value, traceback):
            if kind is not SystemExit:
                self.send(exception=f"{kind.__name__}: {value}")
            previous(kind, value, traceback)

        def thread_hook(args):
            if args.exc_type is not SystemExit:
                self.send(exception=f"{args.exc_type.__name__}: {args.exc_value}")
            previous_in_thread(args)

        sys.excepthook, threading.excepthook = hook, thread_hook


_link = None


def link(rank):
    """This process's Link (made on the first call), or None outside an
    elastic job, or where the launcher cannot be reached."""
    global _link
    job = elastic_job.this_job()
    if job is None:
        return None
    if _link is None or _link[0] != os.getpid():
        try:
            _link = (os.getpid(), Link(job, rank))
        except OSError as error:
            log.warning("rank %d cannot reach mpitrainrun at %s (%s): this job will "
                        "take in new hosts only when it restarts after a loss",
                        rank, job.address, error)
            _link = (os.getpid(), None)
    return _link[1]
