"""The report of a rank that aborts the job, which mpitrainrun sums up last.

A rank's traceback scrolls away under other ranks' output, and a rank that
aborts cannot tell mpitrainrun how it failed except through its output. So
mpitrainrun names a directory in MPITRAIN_REPORT_DIR; a rank that aborts the
job copies what it writes to stderr from its report on into
<directory>/<rank>, and mpitrainrun, after mpirun has exited, ends with one
line naming each failed rank and the exception it raised.
"""

import os
import sys

VARIABLE = "MPITRAIN_REPORT_DIR"


def copy_stderr(rank):
    """From now on, also write what this process writes to sys.stderr into
    its report file (where mpitrainrun asked for one)."""
    directory = os.environ.get(VARIABLE)
    if not directory:
        return
    try:
        copy = open(os.path.join(directory, str(rank)), "a")
    except OSError:
        return
    sys.stderr = _Tee(sys.stderr, copy)


class _Tee:
    """A stream that writes to two. A failing copy must not keep the rank from
    aborting the job, so its errors are ignored."""

    def __init__(self, stream, copy):
        self._stream = stream
        self._copy = copy

    def write(self, text):
        try:
            self._copy.write(text)
        except (OSError, ValueError):
            pass
        return self._stream.write(text)

    def flush(self):
        try:
            self._copy.flush()
        except (OSError, ValueError):
            pass
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def reports(directory):
    """{rank: report} of the ranks that wrote one into directory (a rank
    killed before it flushed its report left an empty file)."""
    texts = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as stream:
            texts[int(name)] = stream.read()
    return {rank: text for rank, text in texts.items() if text}
