"""broadcast_object and allgather_object with Horovod's TensorFlow
signatures, whose ``session`` (a TF1 session to run the graph in) comes
before ``name``; TensorFlow 2 runs eagerly, so a session is refused."""

from mpitrain.api import objects
from mpitrain.api.process_sets import global_process_set


def _refuse_session(session, call):
    if session is not None:
        raise ValueError(f"{call}: session={session!r} is for TF1 sessions, which "
                         "TensorFlow 2 and mpitrain do not have: leave it out")


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` on every rank of ``process_set``."""
    _refuse_session(session, "broadcast_object")
    return objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """The list of every rank's ``obj``, in rank order."""
    _refuse_session(session, "allgather_object")
    return objects.allgather_object(obj, name, process_set)
