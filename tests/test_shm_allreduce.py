"""The shared-memory allreduce (mpitrain.transport.shm) against numpy, in both
modes, and its segment: reserved up front, never left behind."""

import functools
import os
import re
import subprocess
import tempfile

import numpy as np
import pytest

from mpitrain.ops import ReduceOp
from mpitrain.transport.chunk_io import ChunkIO
from mpitrain.transport.shm import NAME_PREFIX, SharedMemoryAllreduce
from tests.mpi_harness import mpi_test, run_mpi

DTYPES = (np.float32, np.float64, np.int32, np.int64, np.uint8)
OPS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
       ReduceOp.PRODUCT: np.multiply}
CHUNK_BYTES = 256           # a few dozen elements: most buffers below span chunks


def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD.Dup()


def drive(collective):
    """Run a collective generator as the engine does, waiting on whatever it
    yields; returns how many times it yielded."""
    from mpi4py import MPI
    yielded = 0
    for requests in collective:
        MPI.Request.Waitall(requests if isinstance(requests, list) else [requests])
        yielded += 1
    return yielded


def barriers(comm, blocking):
    """Ibarrier requests yielded per chunk: none alone, none when blocking."""
    return 0 if blocking or comm.size == 1 else 2


def rank_input(rank, size, dtype, seed=0):
    """Small integers (quarters for floats), so that every order of reduction
    gives the same result and products of three stay exact."""
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "f":
        return (rng.integers(-12, 13, size) / 4).astype(dtype)
    low = 0 if np.dtype(dtype).kind == "u" else -3
    return rng.integers(low, 4, size).astype(dtype)


def expected(op, inputs):
    return functools.reduce(OPS[op], inputs)


def sizes_for(dtype, ranks):
    per_chunk = CHUNK_BYTES // np.dtype(dtype).itemsize
    return (0, 1, 2 * ranks + 1, per_chunk + 1, 3 * per_chunk + 5)


@mpi_test(np=(1, 2, 3), init=False)
def test_every_op_and_dtype_in_both_modes_equals_numpy():
    comm = world()
    for blocking in (True, False):
        reducer = SharedMemoryAllreduce(comm, CHUNK_BYTES, blocking=blocking)
        for dtype in DTYPES:            # one segment, viewed as each dtype in turn
            for op in OPS:
                for size in sizes_for(dtype, comm.size):
                    inputs = [rank_input(rank, size, dtype) for rank in range(comm.size)]
                    buffer = inputs[comm.rank].copy()
                    yielded = drive(reducer.allreduce(buffer, op))
                    np.testing.assert_array_equal(
                        buffer, expected(op, inputs),
                        err_msg=f"{op} of {size} {np.dtype(dtype)}, blocking={blocking}")
                    assert buffer.dtype == dtype
                    chunks = -(-size // (CHUNK_BYTES // np.dtype(dtype).itemsize))
                    assert yielded == barriers(comm, blocking) * chunks
        reducer.close()
        reducer.close()


@mpi_test(np=(1, 2, 3), init=False)
def test_min_and_max_propagate_a_nan_whichever_rank_holds_it():
    comm = world()
    reducer = SharedMemoryAllreduce(comm, CHUNK_BYTES)
    for dtype in (np.float32, np.float64):
        for holder in range(comm.size):
            for op in (ReduceOp.MIN, ReduceOp.MAX):
                buffer = np.arange(100, dtype=dtype) * (comm.rank + 1)
                if comm.rank == holder:
                    buffer[[0, 17, 99]] = np.nan
                drive(reducer.allreduce(buffer, op))
                assert np.isnan(buffer[[0, 17, 99]]).all(), (op, holder)
                assert not np.isnan(np.delete(buffer, [0, 17, 99])).any()
    reducer.close()


@mpi_test(np=(1, 2, 3), init=False)
def test_fill_writes_the_input_and_after_sees_each_result_once():
    comm = world()
    reducer = SharedMemoryAllreduce(comm, CHUNK_BYTES)
    size = 1000
    inputs = [rank_input(rank, size, np.float32) for rank in range(comm.size)]
    want = expected(ReduceOp.SUM, [3 * x for x in inputs])
    buffer = np.full(size, np.nan, np.float32)      # holds no input with fill
    seen = np.zeros(size, int)

    class Tripled(ChunkIO):
        fills = True

        def fill(self, start, stop, destination):
            assert len(destination) == stop - start
            np.multiply(inputs[comm.rank][start:stop], 3, out=destination)

        def reduced(self, start, stop):
            np.testing.assert_array_equal(buffer[start:stop], want[start:stop])
            seen[start:stop] += 1

    drive(reducer.allreduce(buffer, ReduceOp.SUM, Tripled()))
    np.testing.assert_array_equal(buffer, want)
    np.testing.assert_array_equal(seen, 1)
    reducer.close()


@mpi_test(np=(1, 2, 3), init=False)
def test_across_changes_each_reduced_slice_for_every_rank():
    from mpi4py import MPI
    comm = world()
    size = 1000
    inputs = [rank_input(rank, size, np.float64) for rank in range(comm.size)]
    for blocking in (True, False):
        reducer = SharedMemoryAllreduce(comm, CHUNK_BYTES, blocking=blocking)
        elements = []

        def across(reduced):
            elements.append(len(reduced))
            if not blocking:       # what it yields is waited on like the rest
                yield MPI.COMM_SELF.Ibarrier()
            reduced *= 2
            reduced += 1

        buffer = inputs[comm.rank].copy()
        yielded = drive(reducer.allreduce(buffer, ReduceOp.SUM, across=across))
        np.testing.assert_array_equal(buffer, 2 * expected(ReduceOp.SUM, inputs) + 1)
        chunks = -(-size // (CHUNK_BYTES // 8))
        assert len(elements) == chunks
        assert yielded == (barriers(comm, blocking) + (not blocking)) * chunks
        assert comm.allreduce(sum(elements)) == size
        reducer.close()


@mpi_test(np=(1, 2, 3), init=False)
def test_every_rank_holds_bitwise_the_same_result():
    comm = world()
    reducer = SharedMemoryAllreduce(comm, 4096)
    # Random floats: a sum in another order would differ in the last bits.
    buffer = np.random.default_rng(comm.rank).standard_normal(10_000).astype(np.float32)
    drive(reducer.allreduce(buffer, ReduceOp.SUM))
    results = comm.allgather(buffer.tobytes())
    assert all(result == results[0] for result in results)
    reducer.close()


@mpi_test(np=(1, 2, 3), init=False)
def test_the_segment_is_unlinked_once_made():
    comm = world()
    reducer = SharedMemoryAllreduce(comm, CHUNK_BYTES)
    comm.Barrier()          # rank 0 unlinks it once every rank has mapped it
    assert os.path.dirname(reducer.path) == "/dev/shm"
    assert os.path.basename(reducer.path).startswith(NAME_PREFIX)
    assert not os.path.exists(reducer.path)
    reducer.close()


TOO_LARGE_THEN_SMALL = """
import sys
import numpy as np
from mpi4py import MPI
from mpitrain.ops import ReduceOp
from mpitrain.transport.shm import SharedMemoryAllreduce, SharedMemoryUnavailable

comm, directory = MPI.COMM_WORLD, sys.argv[1]
try:
    SharedMemoryAllreduce(comm, 1 << 20, directory=directory)
except SharedMemoryUnavailable as error:
    print(f"rank {comm.rank} raised: {error}", flush=True)
small = SharedMemoryAllreduce(comm, 64 << 10, directory=directory)
buffer = np.ones(100_000, np.float32)
list(small.allreduce(buffer, ReduceOp.SUM))
print(f"rank {comm.rank} reduced: {(buffer == comm.size).all()}", flush=True)
small.close()
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_segment_too_large_for_its_tmpfs_fails_on_every_rank_before_any_use(nprocs):
    with tempfile.TemporaryDirectory() as directory:
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", directory],
                               capture_output=True, text=True)
        if mount.returncode:
            pytest.skip("cannot mount a 1 MiB tmpfs here: " + mount.stderr.strip())
        try:
            job = run_mpi(nprocs, ["-c", TOO_LARGE_THEN_SMALL, directory], timeout=60)
            left = os.listdir(directory)
        finally:
            subprocess.run(["umount", directory], check=True)
    assert job.returncode == 0, job.stdout + job.stderr[-3000:]
    for rank in range(nprocs):
        assert re.search(rf"rank {rank} raised: .*rank 0: cannot reserve \d+ bytes in "
                         rf"{directory}/{NAME_PREFIX}.*No space left on device", job.stdout)
        assert f"rank {rank} reduced: True" in job.stdout          # a segment that fits
    assert left == []


KILLED_MID_ALLREDUCE = """
import os, signal, sys
import numpy as np
from mpi4py import MPI
from mpitrain.ops import ReduceOp
from mpitrain.transport.chunk_io import ChunkIO
from mpitrain.transport.shm import SharedMemoryAllreduce

directory, victim = sys.argv[1], int(sys.argv[2])
comm = MPI.COMM_WORLD
reducer = SharedMemoryAllreduce(comm, 4096, directory=directory)
print("made", reducer.path, flush=True)

class DiesMidway(ChunkIO):
    def reduced(self, start, stop):
        if start > 3 * 1024 and comm.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)

for _ in range(1000):
    list(reducer.allreduce(np.ones(10_000, np.float32), ReduceOp.SUM, DiesMidway()))
"""


@pytest.mark.parametrize("victim", [0, 1])
def test_no_segment_is_left_when_a_rank_is_killed_mid_allreduce(victim):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        job = run_mpi(2, ["-c", KILLED_MID_ALLREDUCE, directory, str(victim)], timeout=60)
        assert job.returncode, job.stderr[-2000:]
        assert job.stdout.count(f"made {directory}/{NAME_PREFIX}") == 2, job.stdout
        assert os.listdir(directory) == []
