"""Horovod's elastic training API: in-process resets, and restarts of the job.

In Horovod's elastic mode workers come and go: training state is committed
in memory, and when a collective fails the workers restore the last commit,
re-form the job and go on. Under MPI the processes of a job are fixed, so
this happens in two ways here.

Within a job, recovery from errors that every rank survives: when the
training function raises HorovodInternalError on any rank, every rank
restores its last commit, restarts mpitrain, takes rank 0's state and calls
the function again. Each reset is an agreement of all ranks: the rank that
failed stops mpitrain with a reason that says so, which fails every other
rank's pending or next collective with that reason; a rank whose function
returned waits in one last collective, so it hears of a reset too. A
ShutdownError for any other reason (a lost or frozen rank, a stall) cannot
be recovered within the job, since the missing rank would never join.

Across jobs, under mpitrainrun's elastic mode (launcher/elastic.py): each
commit is also kept in a file of every host (elastic_store.py), the
launcher starts the job again on the hosts left after a loss, or on more
hosts at the commit after it announced them (elastic_channel.py), and run()
resumes from the newest commit any host holds.
"""

import copy
import functools
import itertools
import logging
import os
import re

import numpy as np

from mpitrain.api import array_ops, basics, elastic_channel, elastic_store
from mpitrain.runtime import config as _config, elastic_job
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
# Each state's number in the order the program makes them: the same in every
# run of the job, so a restart finds each state's own commits.
_state_numbers = itertools.count()


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed: the job stops at this commit and
    mpitrainrun starts it again on the hosts there are (as Horovod's)."""

    def __init__(self, skip_sync=False):
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


class RestartForNewHosts(SystemExit):
    """Ends every rank with status 0 at a commit, so that mpitrainrun starts
    the job again on the hosts there are now."""


class State:
    """Training state that commit() saves in memory and restore() brings back.

    Keyword arguments become attributes (``state.epoch``, ``state.batch``),
    committed and synchronized with the rest. Framework states set their
    own attributes (model, optimizer) before calling this constructor, which
    commits the initial state. ``state.restarts`` is how many times
    mpitrainrun's elastic mode has started the job again (0 otherwise).
    """

    def __init__(self, **kwargs):
        self._reset_callbacks = []
        self._number = next(_state_numbers)
        self._commits = 0
        self._resumed = False
        job = elastic_job.this_job()
        self.restarts = job.restarts if job else 0
        self._link = elastic_channel.link(basics.rank()) if job else None
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
        """Save the state: a later reset or restart comes back to this point.

        Under mpitrainrun's elastic mode the commit is also written to a
        file of every host, in the background, and the job stops here when
        the launcher has announced new hosts (HostsUpdatedInterrupt).
        """
        self.save()
        self._commits += 1
        if self._link is not None:
            _store().keep(self._number, self._commits, self._snapshot())
        self.check_host_updates()

    def reset(self):
        """Called after every reset, before the reset callbacks; a subclass
        re-creates here what depends on the job (Horovod: its size)."""

    def check_host_updates(self):
        """Raise HostsUpdatedInterrupt on every rank when mpitrainrun has told
        rank 0 of added or removed hosts (a collective; nothing outside an
        elastic job)."""
        if self._link is None:
            return
        told = array_ops.broadcast(np.array([self._link.hosts_generation], np.int64), 0,
                                   "mpitrain.elastic.hosts")
        if told[0] > 0:
            raise HostsUpdatedInterrupt()

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

    def _snapshot(self):
        """What the last commit saved, as the hosts' files keep it: the
        attributes save() sets, named _saved_* here and in the subclasses
        (a subclass that keeps its copies elsewhere adds them)."""
        return {name: value for name, value in vars(self).items()
                if name.startswith("_saved_")}

    def _load_snapshot(self, snapshot):
        """Make a kept commit the last one (restore() then applies it)."""
        for name, value in snapshot.items():
            if name.startswith("_saved_"):
                setattr(self, name, value)

    def _resume(self):
        """The first time run() gets this state in an elastic job: go back to
        the newest commit any host holds. Returns whether there was one."""
        if self._link is None or self._resumed:
            return False
        self._resumed = True
        found = elastic_store.resume(_store(), self._number)
        if found is None:
            return False
        self._commits, snapshot, holder = found
        self._load_snapshot(snapshot)
        self.restore()
        if basics.rank() == 0:
            self._link.send(resumed=self._commits, values=_shown(self._saved_values),
                            holder=holder)
        return True

    def _stop_for_new_hosts(self):
        """Every host has written the last commit: end this process, so that
        mpitrainrun starts the job again on the hosts there are now."""
        _store().wait()
        array_ops.allgather(np.zeros(1, np.int8), name="mpitrain.elastic.kept")
        if basics.rank() == 0:
            self._link.send(stopping=self._commits, values=_shown(self._saved_values))
        raise RestartForNewHosts(0)


_stores = {}


def _store():
    """This process's CommitStore; the first rank of each host writes."""
    pid = os.getpid()
    if pid not in _stores:
        _stores[pid] = elastic_store.CommitStore(elastic_job.this_job().host_directory(),
                                                 writes=basics.local_rank() == 0)
    return _stores[pid]


def _shown(values):
    """The plain values of a commit that say where training was (epoch=3)."""
    return {name: value for name, value in values.items()
            if isinstance(value, (int, float, str)) and len(str(value)) <= 40}


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
            # Every rank has just loaded the same commit: nothing to sync.
            synced = state._resume()
            while True:
                try:
                    if not synced:
                        state.sync()
                    synced = False
                    result = func(state, *args, **kwargs)
                    _agree_that_every_rank_is_done()
                    return result
                except HostsUpdatedInterrupt:
                    state._stop_for_new_hosts()
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
