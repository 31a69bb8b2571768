"""Elastic commits kept in files of each host, so that they outlive the job.

Under mpitrainrun's elastic mode a lost rank ends the MPI job, and the job
starts again on the hosts that are left: what ``state.commit()`` held in
memory is gone with the processes. So each commit is also written, by one
rank per host, to a folder of that host (MPITRAIN_ELASTIC_DIR, /dev/shm by
default: memory, not disk). Every rank holds the same state after a commit,
so one surviving host is enough: after a restart the ranks find the newest
commit any host holds and take it from there (``resume``).

A write runs in a thread of its own, from the copy that commit() made, so
training goes on meanwhile; the next commit waits for it. It streams the
state through pickle into a temporary file, then renames it
(checkpoint.write_atomically): a rank killed mid-write leaves the previous
commit in place, and a ``.partial`` file, which the next start removes. The
file ends with the SHA-256 of what comes before it (at the end, so that the
state needs no second copy in memory to be hashed first), and a file whose
checksum does not match is never loaded. Only the newest commit is kept.
The files are pickles, read only from a folder this user made and no one
else can write to.
"""

import hashlib
import os
import pickle
import re
import stat
import threading

import numpy as np

from mpitrain.api import array_ops, basics
from mpitrain.api.checkpoint import write_atomically
from mpitrain.api.objects import allgather_object

MAGIC = b"mpitrain elastic commit 1\n"
DIGEST_SIZE = hashlib.sha256().digest_size


class CommitStoreError(RuntimeError):
    """A commit could not be kept on this host, so a restart could lose it."""


class CommitStore:
    """This host's commits; ``writes`` on one rank per host."""

    def __init__(self, directory, writes):
        self.directory = directory
        self.writes = writes
        self._writing = None            # the thread writing the latest commit
        self._failure = None

    def keep(self, state_index, number, snapshot):
        """Write commit ``number`` of state ``state_index`` in the background,
        after the write before it has finished."""
        self._start(state_index, number, lambda stream: _write_commit(stream, snapshot))

    def keep_bytes(self, state_index, number, data):
        """Keep a commit another host wrote (``data``: its file) here too."""
        self._start(state_index, number, lambda stream: stream.write(data))

    def _start(self, state_index, number, write):
        if not self.writes:
            return
        self.wait()
        self._writing = threading.Thread(
            target=self._write, args=(state_index, number, write), daemon=True,
            name="mpitrain-commit-writer")
        self._writing.start()

    def _write(self, state_index, number, write):
        path = self._path(state_index, number)
        try:
            self._own_folder()
            write_atomically(path, write)
            for older, _ in self._commits(state_index):
                if older < number:
                    os.unlink(self._path(state_index, older))
        except Exception as error:      # reported by the next wait(), on the training thread
            self._failure = (f"could not keep elastic commit {number} in {path}: "
                             f"{type(error).__name__}: {error}; a restart would lose "
                             f"it (free space there, or set MPITRAIN_ELASTIC_DIR "
                             f"to a folder with room for two copies of the state)")

    def wait(self):
        """Wait for the write in progress; raise if a write failed."""
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        if self._failure:
            raise CommitStoreError(self._failure)

    def newest(self, state_index):
        """(number, file bytes) of the newest whole commit of the state held
        here, or (-1, None). Leftovers of writes cut short, and files that
        fail their checksum, are removed."""
        if not self.writes or not os.path.isdir(self.directory):
            return -1, None
        self._own_folder()
        for name in os.listdir(self.directory):
            if name.endswith(".partial"):
                os.unlink(os.path.join(self.directory, name))
        for number, path in self._commits(state_index):
            with open(path, "rb") as stream:
                data = stream.read()
            if checked(data):
                return number, data
            os.unlink(path)
        return -1, None

    def _path(self, state_index, number):
        return os.path.join(self.directory, f"state{state_index}.commit{number}")

    def _commits(self, state_index):
        """[(number, path)] of the state's commit files, newest first."""
        pattern = re.compile(rf"state{state_index}\.commit(\d+)")
        found = [(int(match.group(1)), os.path.join(self.directory, name))
                 for name in os.listdir(self.directory)
                 for match in [pattern.fullmatch(name)] if match]
        return sorted(found, reverse=True)

    def _own_folder(self):
        """Make the folder (only this user may enter it), or refuse one that
        another user could have put files in: they are unpickled."""
        for folder in (os.path.dirname(self.directory), self.directory):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
            status = os.stat(folder)
            if status.st_uid != os.geteuid() or stat.S_IMODE(status.st_mode) & 0o022:
                raise CommitStoreError(f"{folder} belongs to another user or others "
                                       f"may write to it; elastic commits are not kept "
                                       f"or read there")


class _Hashing:
    """A stream that also hashes what goes through it."""

    def __init__(self, stream):
        self.stream = stream
        self.digest = hashlib.sha256()

    def write(self, data):
        self.digest.update(data)
        return self.stream.write(data)


def _write_commit(stream, snapshot):
    stream.write(MAGIC)
    hashing = _Hashing(stream)
    pickle.dump(snapshot, hashing, protocol=5)
    stream.write(hashing.digest.digest())


def checked(data):
    """Whether ``data`` is a whole commit file: its header, and the checksum at its end."""
    return (len(data) >= len(MAGIC) + DIGEST_SIZE and data.startswith(MAGIC)
            and hashlib.sha256(memoryview(data)[len(MAGIC):-DIGEST_SIZE]).digest()
            == data[-DIGEST_SIZE:])


def snapshot_of(data):
    return pickle.loads(memoryview(data)[len(MAGIC):-DIGEST_SIZE])


def _broadcast_bytes(data, root):
    """Rank ``root``'s ``data`` on every rank, as a memoryview: without the
    two copies of it that pickling would make on every rank (broadcast_object)."""
    size = array_ops.broadcast(np.array([0 if data is None else len(data)], np.int64),
                               root, "mpitrain.elastic.commit.size")
    buffer = (np.empty(int(size[0]), np.uint8) if data is None
              else np.frombuffer(data, np.uint8))
    array_ops.synchronize(array_ops.broadcast_async(buffer, root, "mpitrain.elastic.commit",
                                                    output=buffer))
    return memoryview(buffer)


def resume(store, state_index):
    """Every rank calls this at a start: returns (number, snapshot, holder
    rank) of the newest commit any host holds, or None where none does.
    Hosts that lack it keep it too, so that losing the host it came from
    next loses nothing."""
    number, data = store.newest(state_index)
    numbers = allgather_object(number, "mpitrain.elastic.commits")
    newest = max(numbers)
    if newest < 0:
        return None
    holder = numbers.index(newest)
    data = _broadcast_bytes(data if basics.rank() == holder else None, holder)
    if number != newest:
        store.keep_bytes(state_index, newest, data)
    return newest, snapshot_of(data), holder
