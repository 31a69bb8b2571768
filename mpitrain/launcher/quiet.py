"""TensorFlow's start-up notices, dropped from the ranks' stderr.

Importing TensorFlow prints two notices on every rank that no log level
silences, since they come before TensorFlow reads one: absl's "All log
messages before absl::InitializeLog() is called are written to STDERR" and
oneDNN's "oneDNN custom operations are on ...". Only TF_ENABLE_ONEDNN_OPTS=0
removes them, and it turns oneDNN's kernels off, which made a CPU training
step several times slower. So when the job's TF_CPP_MIN_LOG_LEVEL asks for
no INFO lines, mpitrainrun reads mpirun's stderr and drops those lines, and
only those; everything else goes through as it comes, a line at a time.
"""

import re
import sys
import threading

# After the rank tag of Open MPI ("[1,0]<stderr>: ") or MPICH ("[0] "), if any.
NOTICE = re.compile(
    rb"^(\[[\d,]+\](<stderr>)?: ?)?"
    rb"(WARNING: All log messages before absl::InitializeLog\(\) is called are "
    rb"written to STDERR|I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom "
    rb"operations are on\. .*)\r?\n?$")


def wanted(env):
    """Whether the job's settings ask TensorFlow for no INFO lines."""
    try:
        return int(env.get("TF_CPP_MIN_LOG_LEVEL", "0")) >= 1
    except ValueError:
        return False


def copy_without_notices(source):
    """Copy source's lines to this process's stderr, without the notices, in a
    thread of its own; returns the thread, which ends with source."""
    def copy():
        sys.stderr.flush()
        target = getattr(sys.stderr, "buffer", None)
        for line in source:
            if NOTICE.match(line):
                continue
            if target is None:
                sys.stderr.write(line.decode(errors="replace"))
                sys.stderr.flush()
            else:
                target.write(line)
                target.flush()

    thread = threading.Thread(target=copy, name="mpitrainrun-stderr", daemon=True)
    thread.start()
    return thread
