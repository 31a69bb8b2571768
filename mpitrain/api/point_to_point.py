"""Sending a buffer to one rank of a process set, and receiving one, from any thread.

The door to transport/messages.py for the adapters: torch.distributed's
send and recv. Ranks count in the process set; a receive names its source
or takes a message from any rank. ``done(error, source)`` is called once,
on the messages' progress thread, when the message has moved or failed
(a receive whose sender sent another description: a ValueError naming
both; nothing within ``timeout`` seconds: a TimeoutError); it must not
wait there for another message.
"""

import threading

from mpitrain.api import basics

_progress = []                   # the one Progress, once a message is sent
_progress_lock = threading.Lock()


def send(payload, description, dest, tag, process_set, timeout, done, call):
    """Send ``payload`` (a 1-D uint8 array, untouched until done) to rank ``dest``."""
    messages, progress = _transport()
    pair = _pair(messages, process_set, dest, tag, call)
    progress.add(messages.Send(pair, payload, description, dest, tag, done, timeout, call))


def receive(payload, description, source, tag, process_set, timeout, done, call):
    """Receive into ``payload`` (a 1-D uint8 array) from rank ``source`` or any (None)."""
    messages, progress = _transport()
    pair = _pair(messages, process_set, source, tag, call)
    progress.add(messages.Receive(pair, payload, description, source, tag, done, timeout,
                                  call))


def _transport():
    """transport/messages.py and its Progress, imported only now: importing
    mpi4py.MPI before init() would start MPI without mpitrain's settings
    (runtime/topology.py: Open MPI then spins in every blocking call)."""
    basics.engine()
    from mpitrain.transport import messages
    with _progress_lock:
        if not _progress:
            _progress.append(messages.Progress())
    return messages, _progress[0]


def _pair(messages, process_set, peer, tag, call):
    engine = basics.engine()
    if not basics.topology().threads_multiple:
        raise RuntimeError(f"{call}: MPI was initialized without MPI_THREAD_MULTIPLE, "
                           "which messages from any thread need; let mpitrain "
                           "initialize MPI")
    if peer is not None and not 0 <= peer < process_set.size():
        raise ValueError(f"{call}: rank {peer} is not a rank of a group of "
                         f"{process_set.size()}")
    if not 0 <= tag <= messages.largest_tag():
        raise ValueError(f"{call}: tag {tag} is outside MPI's tags, 0 to "
                         f"{messages.largest_tag()}")
    process_set.rank()                 # raises where this rank is not a member
    return engine.message_comms[process_set.process_set_id]
