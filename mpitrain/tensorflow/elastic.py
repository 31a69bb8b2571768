"""Horovod's ``horovod.tensorflow.elastic``.

``TensorFlowKerasState`` and ``run`` are those of
mpitrain.tensorflow.keras.elastic (a reset restores the last commit on every
rank and calls the function again; see docs/fault-tolerance.md);
``TensorFlowState`` commits a list of TensorFlow variables instead of a
model; ``ObjectState`` commits plain values only.
"""

from mpitrain.api.elastic import State
from mpitrain.tensorflow.keras.elastic import TensorFlowKerasState, VariablesState, run

__all__ = ["ObjectState", "TensorFlowKerasState", "TensorFlowState", "run"]

ObjectState = State


class TensorFlowState(VariablesState):
    """TensorFlow variables and plain values, committed together."""

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None:
            raise ValueError("TensorFlowState(session=...) is for TF1 sessions, which "
                             "mpitrain does not support: give the variables")
        if variables is None:
            raise ValueError("TensorFlowState needs variables=[...]: TF2 keeps no "
                             "global variables to take by default")
        self.variables = list(variables)
        super().__init__(**kwargs)

    def _variables(self):
        return self.variables
