"""A rank's unhandled exception keeps its traceback after init_process_group.

torch's init_process_group installs an excepthook that sends sys.stderr to
a buffer, calls the hook before it, and then writes the buffer out with a
"[rank1]:" prefix. The hook before it is mpitrain's, which writes the
traceback and aborts the MPI job (MPITRAIN_ABORT_ON_EXCEPTION): the abort
came before torch wrote the buffer, and the rank's traceback was lost. The
hook this module puts under torch's writes to the process's real stderr
while torch's buffer stands in for it.
"""

import io
import sys


def keep_tracebacks():
    """Wrap the hook torch will call (once per process)."""
    hook = sys.excepthook
    if getattr(hook, "writes_to_the_real_stderr", False):
        return

    def through_the_real_stderr(kind, value, traceback):
        buffer = sys.stderr
        if isinstance(buffer, io.StringIO) and sys.__stderr__ is not None:
            sys.stderr = sys.__stderr__
        try:
            hook(kind, value, traceback)
        finally:
            sys.stderr = buffer
    through_the_real_stderr.writes_to_the_real_stderr = True
    sys.excepthook = through_the_real_stderr
