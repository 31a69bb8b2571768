"""Checkpoints written by one rank, never left half-written by a crash.

A checkpoint is written to a temporary file in its own directory, flushed to
disk, then renamed over the previous one: a rename within a file system is
atomic, so a reader finds either the old checkpoint or the new one, whatever
moment the job died at. The framework helpers (mpitrain.torch's
save_checkpoint and load_checkpoint, and Keras's) build on the two
collective calls here: every rank calls them, one rank touches the file, and
every rank learns how it went.
"""

import os
import tempfile

from mpitrain.objects import broadcast_object
from mpitrain.process_sets import global_process_set


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed on the rank that does it."""


def write_atomically(path, write):
    """Replace ``path`` with what ``write(stream)`` writes, or leave it untouched.

    The new file is complete and on disk before it takes the old one's name;
    if ``write`` raises, or the process dies, ``path`` keeps its old content.
    """
    directory = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    _sync_directory(directory)


def _sync_directory(directory):
    """Make the rename itself durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def save_on_root(path, write, root_rank=0, process_set=global_process_set):
    """Every rank calls this; root_rank writes ``path`` atomically with ``write``.

    An error on the root is raised on every rank, so no rank goes on
    believing the checkpoint exists.
    """
    problem = None
    if process_set.rank() == root_rank:
        try:
            write_atomically(path, write)
        except Exception as error:         # whatever it is, every rank must hear it
            problem = f"{type(error).__name__}: {error}"
    problem = broadcast_object(problem, root_rank, f"mpitrain.checkpoint.save:{path}",
                               process_set)
    if problem:
        raise CheckpointError(f"saving checkpoint {path} failed on rank {root_rank}: "
                              f"{problem}")


def read_on_root(path, read, root_rank=0, process_set=global_process_set):
    """Every rank calls this; on root_rank, returns ``read(path)`` if path exists.

    Returns (found, value): found is the same on every rank; value is what
    ``read`` returned on the root and None elsewhere. An error on the root
    is raised on every rank.
    """
    value, outcome = None, None
    if process_set.rank() == root_rank:
        try:
            found = os.path.exists(path)
            value = read(path) if found else None
            outcome = (found, None)
        except Exception as error:         # whatever it is, every rank must hear it
            outcome = (False, f"{type(error).__name__}: {error}")
    found, problem = broadcast_object(outcome, root_rank,
                                      f"mpitrain.checkpoint.load:{path}", process_set)
    if problem:
        raise CheckpointError(f"loading checkpoint {path} failed on rank {root_rank}: "
                              f"{problem}")
    return found, value
