"""A Chrome-trace timeline of what the engine did, written by rank 0.

Open the file in https://ui.perfetto.dev or chrome://tracing. Each tensor is
a row; its spans show negotiation (enqueue to response), the operation, and
the activities inside it (fusion copies, the MPI call). The file is valid
JSON after every flush: each flush overwrites the closing bracket with the
new events plus a new closing bracket, in one write. A write that fails (a
full disk) ends the timeline with a warning and the file as it was before
that flush; training goes on.
"""

import json
import logging
import os
import threading
import time

from mpitrain.runtime import output_files

log = logging.getLogger("mpitrain")


class Timeline:
    def __init__(self, path, mark_cycles=False):
        self.path = path
        self.mark_cycles = mark_cycles
        self._origin = time.monotonic()
        self._rows = {}             # tensor name -> pid
        self._events = []
        # The engine thread writes; stop_timeline() closes from a user thread.
        self._lock = threading.Lock()
        self._fd = output_files.create(path)
        header = {"name": "process_name", "ph": "M", "pid": 0,
                  "args": {"name": "mpitrain"},
                  "start_time_since_epoch_in_micros": int(time.time() * 1e6)}
        data = ("[\n" + json.dumps(header) + "\n]").encode()
        os.write(self._fd, data)
        self._end = len(data) - 1    # offset of the closing bracket

    def _ts(self, when=None):
        return round(((time.monotonic() if when is None else when)
                      - self._origin) * 1e6, 3)

    def _row(self, name):
        pid = self._rows.get(name)
        if pid is None:
            pid = self._rows[name] = len(self._rows) + 1
            self._events.append({"name": "process_name", "ph": "M", "pid": pid,
                                 "args": {"name": name}})
            self._events.append({"name": "process_sort_index", "ph": "M",
                                 "pid": pid, "args": {"sort_index": pid}})
        return pid

    def begin(self, names, activity, when=None):
        ts = self._ts(when)
        for name in names:
            self._events.append({"name": activity, "ph": "B", "ts": ts,
                                 "pid": self._row(name), "tid": 0})

    def end(self, names, when=None):
        ts = self._ts(when)
        for name in names:
            self._events.append({"ph": "E", "ts": ts, "pid": self._row(name), "tid": 0})

    def mark(self, name, label):
        self._events.append({"name": label, "ph": "i", "s": "p", "ts": self._ts(),
                             "pid": self._row(name), "tid": 0})

    def cycle_start(self):
        if self.mark_cycles:
            self._events.append({"name": "CYCLE_START", "ph": "i", "s": "g",
                                 "ts": self._ts(), "pid": 0, "tid": 0})

    def flush(self):
        with self._lock:
            events, self._events = self._events, []
            if not events or self._fd is None:
                return
            body = "".join(",\n" + json.dumps(e) for e in events)
            data = memoryview((body + "\n]").encode())
            written = 0
            try:
                while written < len(data):      # a large write may come back short
                    written += os.pwrite(self._fd, data[written:], self._end + written)
            except OSError as error:
                self._give_up(error)
                return
            self._end += len(data) - 1

    def _give_up(self, error):
        """Stop writing, and cut the file back to its last valid end."""
        log.warning("the timeline %s stops here, valid up to its last flush: %s; "
                    "training goes on without it", self.path, error)
        try:
            # Shrinking and rewriting a byte already on disk need no free space.
            os.ftruncate(self._fd, self._end + 1)
            os.pwrite(self._fd, b"]", self._end)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def close(self):
        self.flush()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
