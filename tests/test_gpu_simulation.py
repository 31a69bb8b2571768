"""The simulated CUDA device is stricter than a GPU: each property the GPU tests rely on.

tests/test_gpu.py and tests/test_gpu_layouts.py run mpitrain on the simulated
device (devtools/simulated_cupy); they catch a lifetime, ordering or placement
bug only if the device shows it. These tests show each property on the stand-in
itself, in jobs of their own (installing it in the pytest process would hand it
to every other test): device memory that host code refuses, work that runs only
when waited for, streams ordered by events alone, freed memory poisoned and
reused or quarantined, kernels run by references that agree with numpy and
ml_dtypes, NCCL over MPI that leaves the host thread free, MPI that reads device
memory only where it is CUDA-aware and only once the memory is settled.
"""

import sys

import ml_dtypes
import numpy as np
import pytest

from tests import gpu_machine as machine
from tests.mpi_harness import mpi_test

ORDERED = machine.job_env(seed=None)
RANDOM = machine.job_env(seed=3)
QUARANTINE = machine.job_env(seed=None, quarantine=True)
CUDA_AWARE = machine.job_env(seed=None, cuda_aware_mpi=True)
ENDS_THE_DEVICE = machine.job_env(seed=1)      # a job of its own: nothing runs after it
POISON_FLOAT32 = np.uint32(0xFFFFFFFF).view(np.float32)


def device():
    """The stand-in's modules and its internal state (tests of the stand-in only)."""
    from devtools.simulated_cupy import simulation
    return sys.modules["cupy"], simulation.state()


def raw(array):
    """What ``array``'s memory holds now, without waiting for any stream."""
    from devtools.simulated_cupy.memory import DEVICE, host_view
    _, state = device()
    return host_view(state.registry, array.data.ptr, array.shape, array.strides,
                     array.dtype, (DEVICE,), "a test's look").copy()


def run_all():
    device()[1].scheduler.run_everything()


@mpi_test(np=(1,), env=ORDERED, init=False)
def test_host_code_cannot_read_device_memory():
    cupy, _ = device()
    x = cupy.ones(4, cupy.float32)
    for reads in (np.asarray, lambda a: np.copyto(np.empty(4, np.float32), a),
                  memoryview, lambda a: np.frombuffer(a, np.float32)):
        with pytest.raises(TypeError):
            reads(x)
    assert np.array_equal(x.get(), np.ones(4, np.float32))


@mpi_test(np=(1,), env=ENDS_THE_DEVICE, init=False)
def test_device_memory_handed_to_mpi_that_is_not_cuda_aware_ends_the_device():
    from mpi4py import MPI
    from devtools.simulated_cupy import SimulatedCudaError
    cupy, _ = device()
    x = cupy.ones(4, cupy.float32)
    x.get()
    with pytest.raises(TypeError):              # mpi4py's words for a refused buffer
        MPI.COMM_SELF.Allreduce(x, np.empty(4, np.float32))
    with pytest.raises(SimulatedCudaError, match="handed to MPI, which is not CUDA-aware"):
        x.get()                                 # as a crash would, and saying why


@mpi_test(np=(1,), env=ORDERED, init=False)
def test_queued_work_runs_only_when_something_waits_for_it():
    cupy, _ = device()
    x = cupy.empty(1000, cupy.float32)
    assert np.isnan(raw(x)).all(), "new device memory starts poisoned"
    x.fill(2.0)
    y = x * 3
    assert np.isnan(raw(x)).all() and np.isnan(raw(y)).all(), "ran before any wait"
    assert float(y[7].get()) == 6.0            # a copy to the host waits for both
    assert (raw(x) == 2).all() and (raw(y) == 6).all()


@mpi_test(np=(1,), env=ORDERED, init=False)
def test_streams_are_ordered_by_events_only():
    cupy, _ = device()
    producer, consumer = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(
        non_blocking=True)
    for waits in (False, True):
        with producer:
            x = cupy.zeros(100, cupy.float32)
            x.fill(5.0)
            ready = cupy.cuda.Event()
            ready.record(producer)
        with consumer:
            if waits:
                consumer.wait_event(ready)
            y = x + 1
        consumer.synchronize()
        got = raw(y)
        assert (got == 6).all() if waits else not (got == 6).any(), (waits, got[:4])
        run_all()


@mpi_test(np=(1,), env=RANDOM, init=False)
def test_random_mode_runs_other_streams_early_and_ordered_mode_never():
    cupy, state = device()
    ahead = 0
    for _ in range(40):
        a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        with a:
            x = cupy.zeros(10, cupy.float32)
        with b:
            y = cupy.zeros(10, cupy.float32)
        b.synchronize()
        ahead += a._queue.ran == a._queue.queued
        run_all()
    assert 0 < ahead < 40, f"stream a had run by b's wait in {ahead} of 40 draws"
    del x, y


@mpi_test(np=(1,), env=ORDERED, init=False)
def test_a_wait_in_ordered_mode_runs_nothing_it_does_not_need():
    cupy, _ = device()
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with a:
        cupy.zeros(10, cupy.float32)
    with b:
        cupy.zeros(10, cupy.float32)
    b.synchronize()
    assert a._queue.ran < a._queue.queued
    run_all()


@mpi_test(np=(1,), env=ORDERED, init=False)
def test_freed_memory_is_poisoned_and_handed_out_again_first():
    cupy, _ = device()
    x = cupy.full(256, 1.5, cupy.float32)
    address = x.data.ptr
    x.get()
    del x
    y = cupy.empty(256, cupy.float32)          # same size, same stream
    assert y.data.ptr == address
    run_all()
    assert np.isnan(raw(y)).all(), "the old values, not the poison"


@mpi_test(np=(1,), env=QUARANTINE, init=False)
def test_quarantine_says_where_memory_used_after_free_was_freed():
    """As 4cc3c89's bug: an address taken from an array that is then dropped,
    read by work queued after the drop on the same stream."""
    from devtools.simulated_cupy import SimulatedCudaError
    cupy, _ = device()
    runtime = cupy.cuda.runtime
    source = cupy.full(64, 1.0, cupy.float32)
    target = cupy.empty(64, cupy.float32)
    cupy.copyto(target, source)         # queued before the drop: may read it
    address = source.data.ptr
    line = sys._getframe().f_lineno + 1
    del source
    runtime.memcpyAsync(target.data.ptr, address, 256, runtime.memcpyDefault, 0)
    with pytest.raises(SimulatedCudaError) as raised:
        cupy.cuda.get_current_stream().synchronize()
    assert "memcpyAsync" in str(raised.value)
    assert f"use after free (freed at tests/test_gpu_simulation.py:{line})" in str(
        raised.value)
    with pytest.raises(SimulatedCudaError, match="unusable since an earlier error"):
        cupy.zeros(1)                   # sticky, as CUDA's errors are


@mpi_test(np=(1,), env=ORDERED, init=False)
def test_pinned_memory_starts_poisoned_and_faults_after_it_is_freed():
    from devtools.simulated_cupy import SimulatedCudaError
    cupy, _ = device()
    pinned = cupy.cuda.alloc_pinned_memory(64)
    host = np.frombuffer(pinned, np.float32, 16)
    assert np.isnan(host).all()
    x = cupy.zeros(16, cupy.float32)
    runtime = cupy.cuda.runtime
    address = host.ctypes.data
    pageable = np.zeros(16, np.float32)
    with pytest.raises(SimulatedCudaError, match="pinned"):
        runtime.memcpyAsync(x.data.ptr, pageable.ctypes.data, 64, runtime.memcpyDefault, 0)
    del host, pinned
    with pytest.raises(SimulatedCudaError, match="use after free"):
        runtime.memcpyAsync(x.data.ptr, address, 64, runtime.memcpyDefault, 0)


@mpi_test(np=(1,), env=ORDERED, init=False)
def test_a_kernel_runs_only_by_a_reference_pinned_to_its_source():
    from devtools.simulated_cupy import SimulatedCudaError
    from mpitrain.backends import kernels
    cupy, _ = device()
    source = kernels.source(np.dtype(np.float32))
    cupy.RawModule(code=source).compile()
    edited = source.replace("value * (COMPUTE)factor", "value / (COMPUTE)factor")
    assert edited != source
    with pytest.raises(SimulatedCudaError, match="no numpy reference for this CUDA source"):
        cupy.RawModule(code=edited).compile()


@mpi_test(np=(1,), env=ORDERED, init=False)
def test_pack_and_unpack_round_16_bit_floats_as_numpy_and_ml_dtypes_do():
    """mpitrain's own Device.pack and unpack on the stand-in's kernel references,
    against numpy's float16 and ml_dtypes' bfloat16 conversions (round to
    nearest even, infinities, NaN)."""
    from mpitrain.backends import arrays
    cupy, _ = device()
    backend = arrays.device(0)
    generator = np.random.default_rng(0)
    values = np.concatenate([generator.standard_normal(5000).astype(np.float32) * 1e4,
                             np.float32([np.inf, -np.inf, np.nan, 65520.0, 1e-8, -0.0])])
    for dtype in (np.float16, ml_dtypes.bfloat16):
        wide = cupy.asarray(values)
        narrow = cupy.empty(values.shape, dtype)
        cupy.cuda.get_current_stream().synchronize()   # the engine's stream waits for none
        backend.unpack(wide, [0], [wide], [narrow], 0.5)
        want = (values * np.float32(0.5)).astype(dtype)
        got = backend.to_numpy(narrow)
        assert np.array_equal(got.view(np.uint16)[~np.isnan(want)],
                              want.view(np.uint16)[~np.isnan(want)]), dtype
        assert np.isnan(got.astype(np.float32)[np.isnan(want)]).all()
        packed = cupy.empty(values.shape, cupy.float32)
        backend.pack([narrow], [narrow.size], packed, 2.0)
        assert np.array_equal(backend.to_numpy(packed), want.astype(np.float32) * 2,
                              equal_nan=True), dtype


@mpi_test(np=(2, 3), env=ORDERED, init=False)
def test_nccl_over_mpi_leaves_the_host_thread_free_and_drops_nan_in_min_and_max():
    from mpi4py import MPI
    cupy, _ = device()
    from cupy.cuda import nccl      # a submodule that `import cupy` does not load
    world = MPI.COMM_WORLD
    unique_id = world.bcast(nccl.get_unique_id() if world.rank == 0 else None)
    communicator = nccl.NcclCommunicator(world.size, unique_id, world.rank)
    stream = cupy.cuda.Stream(non_blocking=True)
    mine = np.float32([world.rank, np.nan if world.rank == 0 else 1.0, -world.rank])
    for op, reduce in ((nccl.NCCL_SUM, np.add), (nccl.NCCL_MIN, np.fmin),
                       (nccl.NCCL_MAX, np.fmax)):
        with stream:
            x = cupy.asarray(mine)
        if world.rank == 0:             # queued: returns before the others have called
            communicator.allReduce(x.data.ptr, x.data.ptr, 3, nccl.NCCL_FLOAT32, op,
                                   stream.ptr)
            world.Barrier()
        else:
            world.Barrier()
            communicator.allReduce(x.data.ptr, x.data.ptr, 3, nccl.NCCL_FLOAT32, op,
                                   stream.ptr)
        everyone = world.allgather(mine)
        stream.synchronize()
        want = reduce.reduce(np.stack(everyone), axis=0)
        assert np.array_equal(raw(x), want, equal_nan=True), (op, raw(x), want)


@mpi_test(np=(2,), env=CUDA_AWARE, init=False)
def test_cuda_aware_mpi_reads_device_memory_only_once_it_is_settled():
    from mpi4py import MPI
    from devtools.simulated_cupy import SimulatedCudaError
    cupy, _ = device()
    x = cupy.full(8, MPI.COMM_WORLD.rank + 1.0, cupy.float32)
    cupy.cuda.get_current_stream().synchronize()
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x)
    assert (x.get() == 3).all()
    x.fill(0.0)
    with pytest.raises(TypeError):              # mpi4py's words for a refused buffer
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x)
    with pytest.raises(SimulatedCudaError, match="handed to MPI while fill.*has not run"):
        x.get()                                 # the device says why, at its next call


# -- the kernels the references stand for ---------------------------------------------

def test_every_kernel_source_has_its_pinned_reference():
    from devtools.simulated_cupy import kernel_references, kernels as simulated
    from mpitrain.backends import kernels
    changed = {name: simulated.digest(kernels.source(np.dtype(name)))
               for name, pinned in kernel_references.PINNED.items()
               if simulated.digest(kernels.source(np.dtype(name))) != pinned}
    assert not changed, (
        f"mpitrain's kernels changed for {sorted(changed)}: update their numpy references "
        "in devtools/simulated_cupy/kernel_references.py to do what the new CUDA code "
        f"does, then pin the new hashes: {changed}")


def test_the_kernels_compile_with_nvrtc_for_a_hopper_gpu():
    """NVRTC needs no GPU: the sources the references stand for are CUDA that
    compiles, with both entry points, for every wire type."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                                reason="CuPy is not installed here")
    try:
        nvrtc.getVersion()
    except Exception as error:          # the library is a separate wheel
        pytest.skip(f"NVRTC does not load here (pip install nvidia-cuda-nvrtc): {error}")
    from devtools.simulated_cupy import kernel_references
    from mpitrain.backends import kernels
    for name in kernel_references.PINNED:
        program = nvrtc.createProgram(kernels.source(np.dtype(name)), f"{name}.cu", [], [])
        try:
            nvrtc.compileProgram(program, ["--std=c++14", "-arch=compute_90"])
        except nvrtc.NVRTCError as error:
            pytest.fail(f"the {name} kernels do not compile: {error}\n"
                        f"{nvrtc.getProgramLog(program)}")
        ptx = nvrtc.getPTX(program)
        for entry in (b".entry mpitrain_pack", b".entry mpitrain_unpack"):
            assert entry in ptx, (name, entry)
