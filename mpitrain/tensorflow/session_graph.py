"""Collectives in TF1 graphs run by a session: started without blocking, waited for after.

A session's executor starts independent ops in a different order on each
rank, on a few threads. A collective op that blocked until its peers came
would hold one of those threads, and ranks that started different
collectives first would each wait for the other forever (Horovod's kernels
are asynchronous for this reason). So here a collective is two steps. An op
starts its body in a Python thread of its own and returns a ticket at once.
The wait for the ticket runs in a tf.data pipeline read by
``get_single_element``, an asynchronous TensorFlow kernel, on a thread of
the pipeline's own: no executor thread waits, so every rank starts every
collective whatever the order. Inside tf.function none of this is needed:
TensorFlow runs stateful ops there in program order, the same on every rank.
"""

import itertools
import threading

import numpy as np
import tensorflow as tf

_jobs = {}
_tickets = itertools.count()


class _Job:
    """One run of a collective's body, in a thread of its own."""

    def __init__(self, body, arrays):
        self.done = threading.Event()
        self.results = self.error = None
        threading.Thread(target=self._run, args=(body, arrays), daemon=True,
                         name="mpitrain graph collective").start()

    def _run(self, body, arrays):
        try:
            self.results = body(arrays)
        except Exception as error:      # _finish raises it in the session
            self.error = error
        finally:
            self.done.set()


def _start(body, arrays):
    ticket = next(_tickets)
    # Copies: TensorFlow may reuse the inputs' memory once this op returns.
    _jobs[ticket] = _Job(body, [np.array(array) for array in arrays])
    return np.int64(ticket)


def _finish(ticket):
    job = _jobs.pop(int(ticket))
    job.done.wait()
    if job.error is not None:
        raise job.error
    return job.results


def run(body, inputs, output_dtypes, op_name):
    """The outputs of ``body(list of arrays) -> list of arrays`` on ``inputs``."""
    ticket = tf.numpy_function(lambda *arrays: _start(body, arrays), list(inputs),
                               [tf.int64], stateful=True, name=f"{op_name}_start")[0]
    finished = tf.data.Dataset.from_tensors(ticket).map(
        lambda ticket: tuple(tf.numpy_function(_finish, [ticket], list(output_dtypes),
                                               stateful=True, name=op_name)))
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1     # waits on a thread of its own
    return list(finished.with_options(options).get_single_element())
