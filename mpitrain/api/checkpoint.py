"""Checkpoints written by one rank, never left half-written by a crash.

A checkpoint is written to a temporary file in its own directory, flushed to
disk, then renamed over the previous one: a rename within a file system is
atomic, so a reader finds either the old checkpoint or the new one, whatever
moment the job died at. The file starts with a header that holds the
SHA-256 of the rest, so a file damaged later is refused, not loaded. The
framework helpers (mpitrain.torch's save_checkpoint and load_checkpoint,
and Keras's) build on the two collective calls here: every rank calls them,
one rank touches the file, and every rank learns how it went.
"""

import hashlib
import os
import secrets
import stat

from mpitrain.api.objects import broadcast_object
from mpitrain.api.process_sets import global_process_set, is_root

MAGIC = b"mpitrain checkpoint 1\n"


class CheckpointError(RuntimeError):
    """Saving or loading a checkpoint failed on the rank that does it."""


def write_atomically(path, write):
    """Replace ``path`` with what ``write(stream)`` writes, or leave it untouched.

    The new file is complete and on disk before it takes the old one's name;
    if ``write`` raises, or the process dies, ``path`` keeps its old content.
    It keeps the mode of the file it replaces; a new file gets the mode
    open() would give it.
    """
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(
        directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.partial")
    # 0o666 lets the umask decide, as for open(); mkstemp would make it 0o600.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as stream:
            if os.path.exists(path):
                os.fchmod(stream.fileno(), stat.S_IMODE(os.stat(path).st_mode))
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


def write_payload(path, payload):
    """Write ``payload`` to ``path`` atomically, after a header with its SHA-256."""
    def write(stream):
        stream.write(MAGIC)
        stream.write(hashlib.sha256(payload).digest())
        stream.write(payload)

    write_atomically(path, write)


def read_payload(path):
    """The payload that write_payload wrote to ``path``, once its SHA-256 is checked.

    Reads a checkpoint outside a job, too: for a torch one,
    ``torch.load(io.BytesIO(read_payload(path)), weights_only=True)``.
    """
    with open(path, "rb") as stream:
        if stream.read(len(MAGIC)) != MAGIC:
            raise CheckpointError(f"{path} is not an mpitrain checkpoint: it does not "
                                  f"start with the header save_checkpoint writes")
        digest = stream.read(hashlib.sha256().digest_size)
        payload = stream.read()
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: its SHA-256 checksum does not match "
                              f"its content (damaged since it was saved)")
    return payload


def save_on_root(path, serialize, root_rank=0, process_set=global_process_set):
    """Every rank calls this; root_rank writes ``serialize()``'s bytes to ``path``.

    Only the root's ``path`` counts. An error on the root, in ``serialize``
    or in writing, is raised on every rank, so no rank goes on believing
    the checkpoint exists.
    """
    problem = None
    if is_root(root_rank, process_set):
        try:
            write_payload(path, serialize())
        except Exception as error:         # whatever it is, every rank must hear it
            problem = (f"saving checkpoint {path} failed on rank {root_rank}: "
                       f"{type(error).__name__}: {error}")
    problem = broadcast_object(problem, root_rank, "mpitrain.checkpoint.save",
                               process_set)
    if problem:
        raise CheckpointError(problem)


def read_on_root(path, deserialize, root_rank=0, process_set=global_process_set):
    """Every rank calls this; root_rank reads ``path``, if it exists there.

    Returns (found, value) on every rank: whether the root found ``path``,
    and what ``deserialize(payload)`` returned on the root (None if not
    found). Only the root's ``path`` counts. An error on the root is raised
    on every rank; ``deserialize`` must then leave the root's state as it was.
    """
    outcome = None
    if is_root(root_rank, process_set):
        try:
            found = os.path.exists(path)
            outcome = (found, deserialize(read_payload(path)) if found else None, None)
        except Exception as error:         # whatever it is, every rank must hear it
            outcome = (False, None, f"loading checkpoint {path} failed on rank "
                                    f"{root_rank}: {type(error).__name__}: {error}")
    found, value, problem = broadcast_object(outcome, root_rank,
                                             "mpitrain.checkpoint.load", process_set)
    if problem:
        raise CheckpointError(problem)
    return found, value
