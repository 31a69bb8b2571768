"""One line after the traceback of a script that died of a Keras 2 call.

Horovod's TensorFlow 2 benchmark calls ``opt.variables()`` on a plain Keras
optimizer; on Keras 3 ``variables`` is a list, and the script dies with
"'list' object is not callable" before mpitrain is called. The hook, added
to sys.excepthook when mpitrain.tensorflow is imported, prints after the
traceback what to write instead. (mpitrain's own abort-on-exception hook,
installed at init(), calls this one, so the line reaches a multi-rank job's
report too.)
"""

import re
import sys
import traceback

VARIABLES_CALL = re.compile(r"\.variables\(\)")
HINT_FOR_VARIABLES = (
    "mpitrain: `optimizer.variables()` is Keras 2: on Keras 3 `variables` is a "
    "list, so write `optimizer.variables` (what hvd.DistributedOptimizer returns "
    "takes both), or run Keras 2 with `pip install --no-deps tf_keras` and "
    "TF_USE_LEGACY_KERAS=1\n")


def explain_keras2_errors():
    """After the traceback of a script that ends calling Keras 3's
    ``optimizer.variables`` list, print one line saying what to write instead."""
    previous = sys.excepthook
    if getattr(previous, "_mpitrain_keras2_calls", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if issubclass(kind, TypeError) and "'list' object is not callable" in str(value):
            # Inside tf.function the user's line is in the message, eagerly in tb.
            lines = [frame.line or "" for frame in traceback.extract_tb(tb)]
            if any(VARIABLES_CALL.search(text) for text in lines + [str(value)]):
                sys.stderr.write(HINT_FOR_VARIABLES)

    hook._mpitrain_keras2_calls = True
    sys.excepthook = hook
