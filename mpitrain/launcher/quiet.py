"""TensorFlow's start-up notices, dropped from the ranks' stderr.

Importing TensorFlow prints two notices on every rank that no log level
silences, since they come before TensorFlow reads one: absl's "All log
messages before absl::InitializeLog() is called are written to STDERR" and
oneDNN's "oneDNN custom operations are on ...". Only TF_ENABLE_ONEDNN_OPTS=0
removes them, and it turns oneDNN's kernels off, which made a CPU training
step several times slower. So when the job's TF_CPP_MIN_LOG_LEVEL asks for
no INFO lines, mpitrainrun drops those lines, and only those, from the ranks'
output (output.py).
"""

import re

# A line of a rank's output, after its rank tag.
NOTICE = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are "
    rb"written to STDERR|I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom "
    rb"operations are on\. .*)\r?\n?$")


def wanted(env):
    """Whether the job's settings ask TensorFlow for no INFO lines."""
    try:
        return int(env.get("TF_CPP_MIN_LOG_LEVEL", "0")) >= 1
    except ValueError:
        return False

