"""Horovod-era (Keras 2) calls under Keras 3.

Horovod's Keras scripts compile with ``experimental_run_tf_function=False``,
an argument of TensorFlow 2.0-2.3's Keras that Keras 3 refuses. Next to
mpitrain's DistributedOptimizer it has nothing to do (mpitrain's collectives
run inside Keras' compiled train step), so compile drops it there; with any
other optimizer, Keras 3's refusal says in one line what to do.
"""

import functools

import keras

KERAS2_ONLY = "experimental_run_tf_function"
WHAT_TO_DO = (f"{KERAS2_ONLY} is a Keras 2 argument: drop it, or run Keras 2 with "
              "`pip install --no-deps tf_keras` and TF_USE_LEGACY_KERAS=1 "
              "(docs/tensorflow.md#horovod-era-keras-2-calls)")


def accept_horovods_compile_arguments():
    """Let keras.Model.compile take Horovod's experimental_run_tf_function."""
    # Replaced where it is defined (Keras' Trainer), not on keras.Model: Keras
    # compiles a loaded model only if its class does not override compile.
    owner = next(klass for klass in keras.Model.__mro__ if "compile" in vars(klass))
    compile_ = owner.compile
    if getattr(compile_, "_mpitrain_keras2_calls", False):
        return

    @functools.wraps(compile_)
    def compile(self, *args, **kwargs):
        if KERAS2_ONLY in kwargs:
            optimizer = kwargs.get("optimizer", args[0] if args else None)
            if not getattr(optimizer, "_mpitrain_distributed", False):
                raise TypeError(f"Model.compile() got an unexpected keyword argument "
                                f"{KERAS2_ONLY!r}: {WHAT_TO_DO}")
            del kwargs[KERAS2_ONLY]
        return compile_(self, *args, **kwargs)

    compile._mpitrain_keras2_calls = True
    owner.compile = compile

