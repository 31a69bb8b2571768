"""cupy.cuda.nccl over MPI: a communicator from a unique id, allReduce on a device thread.

NCCL's collectives run on the GPU, queued on a stream: the host thread that
queues one goes on at once, and the collective proceeds when every rank's
GPU reaches it. Here each communicator has a device thread that takes its
collectives in order: it waits for the stream's earlier work, moves the
bytes over an MPI communicator of the members, and writes the result; the
stream passes the collective only then. A host thread therefore never
blocks in a collective it queued, and one rank's engine can go on
negotiating while its peers' collectives are under way, as with NCCL.

The members find each other through files named by the unique id (they
share one machine), then make their MPI communicator with
MPI_Comm_create_group, which only they call. MIN and MAX follow CUDA's
fminf/fmaxf (a NaN loses to a number), as NCCL's kernels do.
"""

import os
import queue
import secrets
import shutil
import tempfile
import threading
import time

import numpy as np

from devtools.simulated_cupy import simulation
from devtools.simulated_cupy.memory import DEVICE, EXTERNAL, host_view
from devtools.simulated_cupy.streams import stream_of

available = True
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)

_TYPES = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32,
          NCCL_UINT32: np.uint32, NCCL_INT64: np.int64, NCCL_UINT64: np.uint64,
          NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
_REDUCE = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.fmax, NCCL_MIN: np.fmin}
_JOIN_SECONDS = 60


class NcclError(RuntimeError):
    pass


def get_version():
    return 22807


def get_unique_id():
    """128 bytes, as CuPy 14 gives NCCL's id; the first 16 name the rendezvous."""
    return secrets.token_bytes(16) + bytes(112)


def _rendezvous(unique_id):
    name = unique_id[:16].hex()
    return os.path.join(tempfile.gettempdir(), f"mpitrain-simulated-nccl-{name}"), name


class NcclCommunicator:
    def __init__(self, ndev, commId, rank, config=None):
        from mpi4py import MPI
        if not isinstance(commId, bytes) or len(commId) != 128:
            raise TypeError(f"commId must be the 128 bytes get_unique_id() returns, got "
                            f"{type(commId).__name__}")
        folder, name = _rendezvous(commId)
        os.makedirs(folder, exist_ok=True)
        mine = os.path.join(folder, str(rank))
        with open(mine + ".tmp", "w") as stream:
            stream.write(str(MPI.COMM_WORLD.Get_rank()))
        os.replace(mine + ".tmp", mine)
        deadline = time.monotonic() + _JOIN_SECONDS
        while len([f for f in os.listdir(folder) if not f.endswith(".tmp")]) < ndev:
            if time.monotonic() > deadline:
                raise NcclError(f"ncclSystemError: {ndev} ranks were to join communicator "
                                f"{name}, {len(os.listdir(folder))} did")
            time.sleep(0.005)
        world_ranks = [int(open(os.path.join(folder, str(r))).read()) for r in range(ndev)]
        group = MPI.COMM_WORLD.Get_group().Incl(world_ranks)
        self._comm = MPI.COMM_WORLD.Create_group(group, int(name[:4], 16) % 32768)
        group.Free()
        self._comm.Barrier()                 # everyone has read the files
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        self._rank, self._size = rank, ndev
        self._jobs = queue.Queue()
        threading.Thread(target=self._device, daemon=True,
                         name=f"simulated NCCL {name[:8]}").start()

    def rank_id(self):
        return self._rank

    def size(self):
        return self._size

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        """Queue an allreduce of ``count`` elements on the stream whose handle is
        ``stream``; the call returns at once."""
        if datatype not in _TYPES or op not in (*_REDUCE, NCCL_AVG):
            raise NcclError(f"ncclInvalidArgument: datatype {datatype}, op {op}")
        dtype = np.dtype(_TYPES[datatype])
        scheduler = simulation.state().scheduler
        queue_ = stream_of(stream)._queue
        job, position = scheduler.enqueue_job(queue_, f"NCCL allReduce of {count} "
                                                      f"{dtype}")
        job.touches = [(sendbuf, count * dtype.itemsize), (recvbuf, count * dtype.itemsize)]
        self._jobs.put((job, queue_, position, sendbuf, recvbuf, count, dtype, op))

    def _device(self):
        state = simulation.state()
        while True:
            job, queue_, position, sendbuf, recvbuf, count, dtype, op = self._jobs.get()
            try:
                state.scheduler.wait_for(queue_, position)
                with state.scheduler.lock:
                    send = self._memory(state, sendbuf, count, dtype, "send").copy()
                everyone = np.empty((self._size, count), dtype)
                self._comm.Allgather(send.view(np.uint8), everyone.view(np.uint8))
                with np.errstate(all="ignore"):
                    if op == NCCL_AVG:
                        result = np.add.reduce(everyone, axis=0) / dtype.type(self._size)
                    else:
                        result = _REDUCE[op].reduce(everyone, axis=0)
                with state.scheduler.lock:
                    self._memory(state, recvbuf, count, dtype, "receive")[...] = result
                state.scheduler.finish_job(job)
            except Exception as error:
                state.scheduler.finish_job(job, error)

    def _memory(self, state, address, count, dtype, what):
        return host_view(state.registry, address, (count,), (dtype.itemsize,), dtype,
                         (DEVICE, EXTERNAL), f"NCCL allReduce's {what} buffer")

    def destroy(self):
        self._comm.Free()

    def abort(self):
        self.destroy()
