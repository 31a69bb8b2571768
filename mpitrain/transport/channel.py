"""MPI calls on one communicator, written once for two modes.

Each method is a generator: ``result = yield from channel.method(...)``. A
blocking channel (the job-wide process set) makes the blocking MPI call and
yields nothing; a non-blocking channel (any other process set) starts the
non-blocking call and yields its requests until the engine sees them done.
Only one communicator may block: a rank blocked on one communicator while
its peer blocks on another would deadlock.
"""

import contextlib
import pickle

import numpy as np
from mpi4py import MPI

from mpitrain.ops import ReduceOp
from mpitrain.transport.chunk_io import PLAIN

PIECE = 1 << 30                  # bytes per piece of a large transfer
COUNT_LIMIT = (1 << 31) - 1      # MPI's counts and offsets are C ints (tests lower it)
EXCHANGE_TAG = 77                # rank-to-rank pieces of large gathers and exchanges
WINDOW = 4                       # pieces of a non-blocking allreduce in flight at once
ROUND = "negotiation round"      # what a channel does while it moves no tensor

MPI_OPS = {ReduceOp.AVERAGE: MPI.SUM, ReduceOp.SUM: MPI.SUM,
           ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
           ReduceOp.PRODUCT: MPI.PROD}

MPI_TYPES = {np.dtype(t): m for t, m in [
    (np.uint8, MPI.UINT8_T), (np.int8, MPI.INT8_T), (np.uint16, MPI.UINT16_T),
    (np.int16, MPI.INT16_T), (np.int32, MPI.INT32_T), (np.int64, MPI.INT64_T),
    (np.float32, MPI.FLOAT), (np.float64, MPI.DOUBLE)]}


_NUMPY_OPS = {}              # (ReduceOp, dtype) -> MPI.Op, made once MPI has started


def propagates_nan(op, dtype):
    """Must ``op`` on ``dtype`` keep a NaN from any rank, as numpy's Min and Max do?"""
    return op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "f"


def numpy_operation(op, dtype):
    """Does mpi_operation give numpy's operation, which reads host memory only?"""
    wrapping = op in (ReduceOp.SUM, ReduceOp.AVERAGE) and dtype.itemsize == 1
    return propagates_nan(op, dtype) or wrapping


def mpi_operation(op, dtype):
    """The MPI operation of ``op`` on ``dtype``.

    Two of MPI's give other results than numpy's, so numpy's run instead:
    MIN and MAX of floats keep or drop a NaN depending on which rank holds
    it (numpy's always propagate it), and Open MPI 5's vectorized SUM of
    8-bit integers saturates from 64 elements on (numpy's wraps around).
    """
    if not numpy_operation(op, dtype):
        return MPI_OPS[op]
    key = (op, dtype)
    if key not in _NUMPY_OPS:
        combine = {ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}.get(op, np.add)

        def reduce(incoming, inout, datatype):
            result = np.frombuffer(inout, dtype)
            combine(np.frombuffer(incoming, dtype), result, out=result)

        _NUMPY_OPS[key] = MPI.Op.Create(reduce, commute=True)
    return _NUMPY_OPS[key]


def even_split(count, parts):
    """How many of count items each of parts gets: even, extras to the first."""
    base, extra = divmod(count, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]


def as_bytes(array):
    return array.reshape(-1).view(np.uint8)


class Channel:
    def __init__(self, comm, blocking, chunk_size, guard=None, host_route=None):
        self.comm = comm
        self.blocking = blocking
        # how large host allreduces travel where not through MPI's allreduce
        # (mpitrain.transport.host; only on the blocking channel)
        self.host_route = host_route
        # guard(what) wraps every blocking call, so that one which stops
        # moving data is noticed (mpitrain.engine.watch); activity says what for.
        self.guard = guard
        self.activity = ROUND
        # Open MPI reduces 1-16 MiB per call faster per byte than larger calls.
        self.chunk_size = chunk_size
        self.rank = comm.rank
        self.size = comm.size

    def _blocking(self, what):
        """The guard of one blocking call (a no-op without a watch)."""
        if self.guard is None:
            return contextlib.nullcontext()
        return self.guard(f"{what} of the {self.activity}")

    def round(self, vector):
        """The control round: always non-blocking, so an idle rank can sleep."""
        yield self.comm.Iallreduce(MPI.IN_PLACE, vector, MPI.BAND)

    def arrive(self):
        """Before blocking calls: wait, sleeping, until every rank is about to make them.

        A round completes for the rank that joined it last at once, but for an
        early rank only when it next wakes; without this, the late rank would
        spin in the blocking call for that long, on its training thread's core.
        """
        if self.blocking:
            yield self.comm.Ibarrier()

    def agree(self, flag):
        """Did any rank raise ``flag``? Returns the same answer on every rank.

        Non-blocking, so it also serves as the arrival before blocking calls.
        """
        vote = np.array([1 if flag else 0], dtype=np.int32)
        yield self.comm.Iallreduce(MPI.IN_PLACE, vote, MPI.MAX)
        return bool(vote[0])

    def chunk_elements(self, itemsize):
        """Elements of itemsize bytes in one piece of an MPI allreduce."""
        return max(1, self.chunk_size // itemsize)

    def chunks(self, count, itemsize):
        """(start, stop) of the pieces of about chunk_size bytes that allreduce makes."""
        step = self.chunk_elements(itemsize)
        return [(start, min(start + step, count))
                for start in range(0, max(count, 1), step)]

    def allreduce(self, buffer, op, io=PLAIN):
        """MPI's allreduce of a 1-D buffer in place, in chunks of about chunk_size
        bytes: host memory, or device memory where the route table says MPI
        takes it (mpitrain.transport.routes). io (a ChunkIO) fills each chunk
        right before it travels and hands its result on right after it
        arrives: on the blocking channel while it is still in cache."""
        mpi_op = mpi_operation(op, buffer.dtype)
        mpi_type = MPI_TYPES[buffer.dtype]
        bounds = self.chunks(buffer.size, buffer.itemsize)
        if self.blocking:
            for start, stop in bounds:
                if io.fills:
                    io.fill(start, stop, buffer[start:stop])
                with self._blocking("MPI_Allreduce"):
                    self.comm.Allreduce(MPI.IN_PLACE, [buffer[start:stop], mpi_type],
                                        mpi_op)
                io.arrived(buffer, start, stop)
            return
        # At most WINDOW pieces in flight: they complete one after another,
        # which shows the transfer moving (mpitrain.engine.watch), and a piece's
        # result is handed on while the next ones travel.
        in_flight = []
        for start, stop in bounds:
            if io.fills:
                io.fill(start, stop, buffer[start:stop])
            in_flight.append((start, stop, self.comm.Iallreduce(
                MPI.IN_PLACE, [buffer[start:stop], mpi_type], mpi_op)))
            if len(in_flight) == WINDOW:
                yield from _completed(in_flight.pop(0), buffer, io)
        for piece in in_flight:
            yield from _completed(piece, buffer, io)

    def allreduce_by_host_reducer(self, buffer, op, io=PLAIN):
        """The job's host reducer (shared memory, or hierarchical) on a 1-D host
        buffer, its barriers watched like this channel's calls; as allreduce,
        and the reducer may combine this rank's input where io.read says it
        lies (SharedMemoryAllreduce.allreduce)."""
        yield from self.host_route.reducer.allreduce(buffer, op, io, guard=self._blocking)

    def close(self):
        """Let go of the host route's shared memory (the communicator is the owner's)."""
        if self.host_route is not None:
            self.host_route.close()

    def allgatherv(self, send, receive, counts):
        """Gather byte views; counts are bytes per rank."""
        starts = starts_of(counts)
        if self.host_route is not None and self.host_route.gathers(starts[-1]):
            yield from self.host_route.gatherer.allgatherv(send, receive, counts,
                                                           guard=self._blocking)
            return
        if starts[-1] > COUNT_LIMIT:         # counts or offsets past MPI's int
            me = self.rank
            receive[starts[me]:starts[me + 1]] = send
            yield from self.exchange(
                {peer: send for peer in range(self.size) if peer != me},
                {peer: receive[starts[peer]:starts[peer + 1]]
                 for peer in range(self.size) if peer != me})
            return
        spec = [receive, counts, None, MPI.BYTE]
        if self.blocking:
            with self._blocking("MPI_Allgatherv"):
                self.comm.Allgatherv([send, MPI.BYTE], spec)
            return
        yield self.comm.Iallgatherv([send, MPI.BYTE], spec)

    def bcast(self, buffer, root):
        """Broadcast a byte view, in pieces: MPI counts stop at 2**31 - 1."""
        pieces = _pieces(buffer)
        if self.blocking:
            for piece in pieces:
                with self._blocking("MPI_Bcast"):
                    self.comm.Bcast([piece, MPI.BYTE], root)
            return
        yield [self.comm.Ibcast([piece, MPI.BYTE], root) for piece in pieces]

    def alltoall(self, send, receive):
        """Exchange int64s, as many for each rank pair: send[j] goes to rank j,
        receive[j] comes from it."""
        if self.blocking:
            with self._blocking("MPI_Alltoall"):
                self.comm.Alltoall(send, receive)
            return
        yield self.comm.Ialltoall(send, receive)

    def alltoallv(self, send, send_counts, receive, receive_counts, total):
        """Exchange byte views; counts are bytes per rank.

        total: the bytes that every rank sends, summed over the ranks. It, the
        same number on every rank, chooses between MPI's Alltoallv and the
        point-to-point path: this rank's own counts would let ranks choose
        differently and wait in different MPI calls forever. Past MPI's int,
        a rank's counts or offsets may be too (the sum bounds them all).
        """
        sent, received = starts_of(send_counts), starts_of(receive_counts)
        if total > COUNT_LIMIT:
            me = self.rank
            receive[received[me]:received[me + 1]] = send[sent[me]:sent[me + 1]]
            others = [peer for peer in range(self.size) if peer != me]
            yield from self.exchange(
                {peer: send[sent[peer]:sent[peer + 1]] for peer in others},
                {peer: receive[received[peer]:received[peer + 1]] for peer in others})
            return
        send_spec = [send, send_counts, None, MPI.BYTE]
        receive_spec = [receive, receive_counts, None, MPI.BYTE]
        if self.blocking:
            with self._blocking("MPI_Alltoallv"):
                self.comm.Alltoallv(send_spec, receive_spec)
            return
        yield self.comm.Ialltoallv(send_spec, receive_spec)

    def exchange(self, outgoing, incoming):
        """Send and receive byte views rank to rank, in pieces below MPI's limits:
        outgoing[peer] goes to peer, incoming[peer] comes from it."""
        requests = []
        for peer, view in incoming.items():
            requests += [self.comm.Irecv([piece, MPI.BYTE], peer, EXCHANGE_TAG)
                         for piece in _pieces(view)]
        for peer, view in outgoing.items():
            requests += [self.comm.Isend([piece, MPI.BYTE], peer, EXCHANGE_TAG)
                         for piece in _pieces(view)]
        if not self.blocking:
            yield requests
            return
        while requests:          # a piece at a time, so that the watch sees progress
            with self._blocking("MPI_Waitany"):
                index = MPI.Request.Waitany(requests)
            requests.pop(index)

    def reduce_scatter(self, send, receive, counts, op):
        """counts are elements per rank: the same on every rank, as is the
        route their sum chooses."""
        if self.host_route is not None and self.host_route.scatters(send.nbytes):
            yield from self.host_route.scatterer.reduce_scatter(send, receive, counts, op,
                                                                guard=self._blocking)
            return
        mpi_type = MPI_TYPES[send.dtype]
        args = ([send, mpi_type], [receive, mpi_type], counts,
                mpi_operation(op, send.dtype))
        if self.blocking:
            with self._blocking("MPI_Reduce_scatter"):
                self.comm.Reduce_scatter(*args)
            return
        yield self.comm.Ireduce_scatter(*args)

    def gather_objects(self, obj):
        """Gather picklable objects to rank 0; other ranks get None."""
        if self.blocking:
            with self._blocking("MPI_Gather"):
                return self.comm.gather(obj, root=0)
        data = _pickled(obj)
        sizes = np.zeros(self.size, dtype=np.int64)
        yield self.comm.Igather(np.array([data.size], dtype=np.int64), sizes, root=0)
        if self.rank != 0:
            yield self.comm.Igatherv([data, MPI.BYTE], None, root=0)
            return None
        received = np.empty(int(sizes.sum()), dtype=np.uint8)
        yield self.comm.Igatherv([data, MPI.BYTE],
                                 [received, sizes.tolist(), None, MPI.BYTE], root=0)
        return _unpickled(received, sizes)

    def bcast_object(self, obj):
        """Broadcast a picklable object from rank 0."""
        if self.blocking:
            with self._blocking("MPI_Bcast"):
                return self.comm.bcast(obj, root=0)
        data = _pickled(obj) if self.rank == 0 else None
        size = np.array([0 if data is None else data.size], dtype=np.int64)
        yield self.comm.Ibcast(size, root=0)
        if data is None:
            data = np.empty(int(size[0]), dtype=np.uint8)
        yield self.comm.Ibcast([data, MPI.BYTE], root=0)
        return pickle.loads(data)

    def allgather_objects(self, obj):
        """Every rank's picklable object, on every rank."""
        if self.blocking:
            with self._blocking("MPI_Allgather"):
                return self.comm.allgather(obj)
        data = _pickled(obj)
        sizes = np.zeros(self.size, dtype=np.int64)
        yield self.comm.Iallgather(np.array([data.size], dtype=np.int64), sizes)
        received = np.empty(int(sizes.sum()), dtype=np.uint8)
        yield self.comm.Iallgatherv([data, MPI.BYTE],
                                    [received, sizes.tolist(), None, MPI.BYTE])
        return _unpickled(received, sizes)


def starts_of(counts):
    """Where each part starts, and the end: [0, c0, c0 + c1, ...]."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + int(count))
    return starts


def _pieces(view):
    return [view[i:i + PIECE] for i in range(0, max(view.size, 1), PIECE)]


def _completed(piece, buffer, io):
    """Wait for one piece of a non-blocking allreduce, then hand its result on."""
    start, stop, request = piece
    yield request
    io.arrived(buffer, start, stop)


def _pickled(obj):
    return np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)


def _unpickled(received, sizes):
    """The objects pickled one after another into ``received``, ``sizes`` bytes each."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(received[offsets[i]:offsets[i + 1]])
            for i in range(len(sizes))]
