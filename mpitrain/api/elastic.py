"""Horovod's elastic training API, within a fixed MPI world.

In Horovod's elastic mode workers come and go: training state is committed
in memory, and when a collective fails the workers restore the last commit,
re-form the job and go on. Under plain MPI the processes are fixed and a lost
process ends the whole job (docs/fault-tolerance.md). What remains is the
recovery from errors that every rank survives: when the training function
raises HorovodInternalError on any rank, every rank restores its last commit,
restarts mpitrain, takes rank 0's state and calls the function again.

Each reset is an agreement of all ranks: the rank that failed stops
mpitrain with a reason that says so, which fails every other rank's pending
or next collective with that reason; a rank whose function returned waits
in one last collective, so it hears of a reset too. A ShutdownError for any
other reason (a lost or frozen rank, a stall) is not recoverable here, since
the missing rank would never join the restart: it is raised, and the job
ends as any failed job does.
"""

import copy
import functools
import logging
import re

import numpy as np

from mpitrain.api import array_ops, basics
from mpitrain.runtime import config as _config
from mpitrain.errors import (
    CollectiveNotImplementedError, CollectiveTypeError, CollectiveValueError,
    HorovodInternalError, MismatchError, ShutdownError)
from mpitrain.api.objects import broadcast_object

log = logging.getLogger("mpitrain")

RESET_REASON = "elastic reset after a recoverable error"
# Retrying cannot fix the same bad input: these end run() at once.
_INPUT_ERRORS = (MismatchError, CollectiveValueError, CollectiveTypeError,
                 CollectiveNotImplementedError)
_RESET_ONLY = re.compile(r"mpitrain has been shut down \(rank \d+: {0}(; rank \d+: {0})*\)"
                         .format(re.escape(RESET_REASON)))


class State:
    """Training state that commit() saves in memory and restore() brings back.

    Keyword arguments become attributes (``state.epoch``, ``state.batch``),
    committed and synchronized with the rest. Framework states set their
    own attributes (model, optimizer) before calling this constructor, which
    commits the initial state.
    """

    def __init__(self, **kwargs):
        self._reset_callbacks = []
        self._values = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.save()

    def register_reset_callbacks(self, callbacks):
        """Functions to call after every reset, before training resumes."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Save the state in memory: a later reset comes back to this point."""
        self.save()
        self.check_host_updates()

    def reset(self):
        """Called after every reset, before the reset callbacks; a subclass
        re-creates here what depends on the job (Horovod: its size)."""

    def check_host_updates(self):
        """Horovod raises here when hosts were added or removed; under MPI they never are."""

    def save(self):
        self._saved_values = {name: copy.deepcopy(getattr(self, name))
                              for name in self._values}

    def restore(self):
        self._restore_values()

    def sync(self):
        """Give every rank rank 0's committed values."""
        self._saved_values = broadcast_object(self._saved_values, 0,
                                              "mpitrain.elastic.values")
        self._restore_values()

    def _restore_values(self):
        for name, value in self._saved_values.items():
            setattr(self, name, copy.deepcopy(value))


def is_recoverable(error):
    """Whether run() restores and retries after ``error``."""
    if isinstance(error, ShutdownError):
        return bool(_RESET_ONLY.fullmatch(str(error)))
    return isinstance(error, HorovodInternalError) and not isinstance(error, _INPUT_ERRORS)


def mentions_only_resets(message):
    """Whether a framework's error message carries a shutdown caused by resets only."""
    return _RESET_ONLY.search(message) is not None


def run_with(recoverable):
    """A run() decorator that retries after the errors ``recoverable`` accepts."""
    def run(func):
        """Call ``func(state, ...)`` until it returns, resetting after recoverable errors.

        Before each call every rank takes rank 0's state (state.sync()).
        After a recoverable error every rank restores its last commit,
        mpitrain restarts, and the reset callbacks run. After
        MPITRAIN_ELASTIC_RESET_LIMIT resets (default 3) the error is raised,
        and mpitrain stops so that the other ranks raise too.
        """
        @functools.wraps(func)
        def wrapper(state, *args, **kwargs):
            limit = _config.from_environ().elastic_reset_limit
            resets = 0
            while True:
                try:
                    state.sync()
                    result = func(state, *args, **kwargs)
                    _agree_that_every_rank_is_done()
                    return result
                except Exception as error:
                    if not recoverable(error):
                        raise
                    if limit and resets >= limit:
                        basics._stop(f"elastic.run gave up after {resets} resets: "
                                     f"{type(error).__name__}: {error}")
                        raise
                    resets += 1
                    log.warning("%s: %s; restoring the last commit and retrying "
                                "(reset %d)", type(error).__name__, error, resets)
                state.restore()
                _restart_mpitrain()
                state.on_reset()
        return wrapper
    return run


run = run_with(is_recoverable)


def _agree_that_every_rank_is_done():
    """Wait for every rank to finish, so a rank that resets late is not left alone."""
    array_ops.allreduce(np.zeros(1, np.int8), name="mpitrain.elastic.done")


def _restart_mpitrain():
    """Stop the engine on every rank (telling them why), then start it again.

    Process sets other than the job-wide one are not re-created.
    """
    basics._stop(RESET_REASON)
    basics.init()
