"""The report of a rank that aborts the job, which mpitrainrun prints again last.

Open MPI prints its own messages about the abort after the rank's report, and
other ranks' output interleaves with it. So mpitrainrun names a directory in
MPITRAIN_REPORT_DIR; a rank that aborts the job copies what it writes to
stderr from its report on into <directory>/<rank>, and mpitrainrun prints
those files after mpirun has exited.
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
    """The reports the ranks wrote into directory, in rank order (a rank
    killed before it flushed its report left an empty file)."""
    texts = []
    for rank in sorted(int(name) for name in os.listdir(directory)):
        with open(os.path.join(directory, str(rank))) as stream:
            texts.append(stream.read())
    return [text for text in texts if text]
