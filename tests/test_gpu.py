"""The GPU path: CuPy arrays, torch CUDA tensors, TensorFlow GPU tensors.

On a GPU machine these run on its GPUs, on the transport the environment and
the MPI library give (run them once per transport: shared/gpu/on-device.sh
runs staged, CUDA-aware Open MPI and NCCL); ranks share the machine's GPUs
round-robin by local rank, and NCCL, which needs a GPU for each rank, skips
where there are fewer GPUs than ranks, so one-rank jobs with
MPITRAIN_TEST_ONE_RANK_PIPELINE=1 run each route's whole path (NCCL's too) on
a machine with one GPU. Everywhere else they run on the simulated CUDA
device, on each of the three routes (tests/gpu_machine.py).
A failure says the device, the transport, the routes taken, the arrays'
layouts and the first wrong values (tests/gpu_report.py).
"""

import contextlib
import gc

import ml_dtypes
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.api import engine_sizes
from mpitrain.backends import arrays
from tests import gpu_machine as machine
from tests.gpu_report import device_route, expect, expect_route, watch_routes
from tests.mpi_harness import mpi_test

pytestmark = pytest.mark.gpu
ROUTES = machine.ROUTES


def use_my_gpu():
    watch_routes()
    cupy = arrays.cupy()
    cupy.cuda.Device(mt.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


def as_bfloat16(cupy, values):
    """A CuPy bfloat16 array (CuPy 14 holds ml_dtypes.bfloat16), made from its bits."""
    host = np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16)
    return cupy.asarray(host.view(np.uint16)).view(ml_dtypes.bfloat16)


def fused_alone_and_16_bit():
    cupy = use_my_gpu()
    r, n = mt.rank(), mt.size()
    small = [cupy.full(1000 + i, r + i, cupy.float32) for i in range(20)]
    big = cupy.full(3 * 1024 * 1024, r + 1, cupy.float32)        # reduced alone
    values = np.float32([2049.0, 0.1, 65504.0 / 8, -3.3, 1e-4])
    wide = {np.dtype(np.float16): [(values + k * 0.7).astype(np.float16) for k in range(n)],
            np.dtype(ml_dtypes.bfloat16): [(values + k * 0.7).astype(ml_dtypes.bfloat16)
                                           for k in range(n)]}
    half = cupy.asarray(wide[np.dtype(np.float16)][r])
    brain = as_bfloat16(cupy, wide[np.dtype(ml_dtypes.bfloat16)][r])
    handles = [mt.allreduce_async(a, name=f"small.{i}", op=mt.Sum)
               for i, a in enumerate(small)]
    handles.append(mt.allreduce_async(big, name="big"))
    handles.append(mt.allreduce_async(half, name="half", op=mt.Sum))
    handles.append(mt.allreduce_async(brain, name="brain", op=mt.Sum))
    handles.append(mt.allreduce_async(cupy.full(7, r, cupy.int32), name="int", op=mt.Max))
    handles.append(mt.allreduce_async(cupy.full(6, 100, cupy.int8), name="int8.average"))
    # The mean of sevens is 7 when divided once, after the sum; on 3 ranks, three
    # float32(7 / 3) add up to 7.0000005.
    handles += [mt.allreduce_async(cupy.full(9 + i, 7.0, cupy.float32), name=f"sevens.{i}")
                for i in range(2)]
    results = [mt.synchronize(h) for h in handles]
    for i, result in enumerate(results[:20]):
        assert isinstance(result, cupy.ndarray) and result is not small[i], type(result)
        expect(result, sum(k + i for k in range(n)), f"fused sum small.{i}", [small[i]])
    expect(results[20], sum(k + 1 for k in range(n)) / n, "average of big, alone", [big])
    for result, (dtype, inputs), source in zip(results[21:23], wide.items(), (half, brain)):
        assert result.dtype == dtype, (result.dtype, dtype)
        exact = sum(x.astype(np.float32) for x in inputs).astype(dtype)
        expect(result, exact, f"{dtype} sum, rounded once", [source])
    expect(results[23], n - 1, "int32 max")
    assert results[24].dtype == cupy.int8, results[24].dtype
    expect(results[24], 100, "int8 average, summed in int64")
    for result in results[25:27]:
        expect(result, 7.0, "float32 average of sevens, fused: divided after the sum")
    expect(small[0], r, "the input of an out-of-place allreduce (unchanged)")
    expect_route("GPU float32 average", device_route())


@mpi_test(np=(1, 2, 3), envs=ROUTES, skip=machine.runnable)
def test_fused_alone_and_16_bit_allreduce():
    fused_alone_and_16_bit()


@mpi_test(np=(2,), env=machine.job_env(machine.NCCL, shared=True), init=False,
          skip=machine.sharing_a_gpu)
def test_nccl_on_a_shared_gpu_fails_init_on_every_rank_and_says_what_instead():
    with pytest.raises(ValueError) as raised:
        mt.init()
    message = str(raised.value)
    assert message.startswith("init() failed on ranks 0, 1: MPITRAIN_GPU_OPERATIONS=nccl "
                              "cannot work here: ranks 0, 1 share the 1 GPU of host")
    assert "Use MPITRAIN_GPU_OPERATIONS=mpi" in message


@mpi_test(np=(2,), env=machine.job_env(shared=True), skip=lambda nprocs, env: (
    "the environment chooses the transport" if "MPITRAIN_GPU_OPERATIONS" in env else
    machine.sharing_a_gpu(nprocs, env)))
def test_by_default_ranks_sharing_a_gpu_use_mpi_and_say_why():
    plan = mt.api.basics.engine().device_plan
    assert not plan.nccl and "share the 1 GPU of host" in plan.reason


def in_place_and_the_other_collectives():
    cupy = use_my_gpu()
    r, n = mt.rank(), mt.size()
    grads = [cupy.full((30, 7), float(r), cupy.float32) for _ in range(3)]
    grads.append(cupy.full(2 * 1024 * 1024, float(r), cupy.float32))     # alone
    grads.append(cupy.full((8, 6), float(r), cupy.float32)[:, ::2])      # strided
    handles = [mt.allreduce_async(g, name=f"grad.{i}", output=g) for i, g in enumerate(grads)]
    for i, (handle, g) in enumerate(zip(handles, grads)):
        assert mt.synchronize(handle) is g, f"grad.{i}: the result is not the output given"
        expect(g, sum(range(n)) / n, f"in-place average grad.{i}", [g])
    gathered = mt.allgather(cupy.full((r + 1, 2), r, cupy.int32))
    assert isinstance(gathered, cupy.ndarray), type(gathered)
    expect(gathered, np.repeat(np.arange(n, dtype=np.int32), np.arange(1, n + 1))[:, None]
           * np.ones(2, np.int32), "allgather of (r + 1, 2) int32")
    root = n - 1
    expect(mt.broadcast(cupy.full(4, r, cupy.float64), root_rank=root), root, "broadcast")
    target = cupy.full(3, r, cupy.float32)
    assert mt.synchronize(mt.broadcast_async(target, root, output=target)) is target
    expect(target, root, "in-place broadcast")
    rows, received = mt.alltoall(cupy.arange(2 * n, dtype=cupy.float32))
    assert isinstance(rows, cupy.ndarray), type(rows)
    expect(rows, np.tile(np.float32([2 * r, 2 * r + 1]), n), "alltoall of 2 rows each")
    assert list(received) == [2] * n, list(received)
    expect(mt.reducescatter(cupy.ones((n, 3), cupy.float32), op=mt.Sum), np.full((1, 3), n),
           "reducescatter sum")
    brain = mt.allgather(as_bfloat16(cupy, [r + 0.5]))
    assert brain.dtype == ml_dtypes.bfloat16, brain.dtype
    expect(brain, [k + 0.5 for k in range(n)], "allgather of bfloat16")
    expect_route("GPU float32 average", device_route())


@mpi_test(np=(1, 2, 3), envs=ROUTES, skip=machine.runnable)
def test_in_place_and_the_other_collectives():
    in_place_and_the_other_collectives()


def whole_pipeline():
    """The allreduces above on one rank that moves its buffers as a larger job does."""
    fused_alone_and_16_bit()
    in_place_and_the_other_collectives()
    for kind in ("GPU float32 sum", "GPU int32 max", "GPU int64 average"):
        expect_route(kind, device_route())


@mpi_test(np=(1,), envs=machine.ONE_RANK_PIPELINES)
def test_one_rank_takes_the_whole_device_pipeline():
    whole_pipeline()


@mpi_test(np=(2, 3), env=machine.job_env(dict(machine.STAGED, MPITRAIN_CHUNK_SIZE=str(1 << 20))))
def test_a_staged_allreduce_of_many_chunks_pipelines_to_the_right_sum():
    cupy = use_my_gpu()
    r, n = mt.rank(), mt.size()
    count = 16 * 1024 * 1024                      # 64 MiB: 64 chunks of 1 MiB
    x = cupy.arange(count, dtype=cupy.float32) % 1000 + r
    out = mt.allreduce(x, op=mt.Sum)
    want = (np.arange(count, dtype=np.float32) % 1000) * n + sum(range(n))
    expect(out, want, "64 MiB sum in 64 chunks", [x])
    fused = [cupy.full(100_000, float(r + i), cupy.float32) for i in range(30)]   # 12 MB
    for i, result in enumerate(mt.grouped_allreduce(fused, op=mt.Sum)):
        expect(result, sum(k + i for k in range(n)), f"fused sum {i} of 30", [fused[i]])
    expect_route("GPU float32 sum", "staged")


@mpi_test(np=(3,), envs=ROUTES, skip=machine.runnable)
def test_a_process_set_reduces_device_buffers_among_its_members():
    cupy = use_my_gpu()
    r = mt.rank()
    outer = mt.add_process_set([0, 2])
    try:
        if outer.included():
            small = [cupy.full(100, r + i, cupy.float32) for i in range(5)]
            big = cupy.full(1 << 20, r, cupy.float32)
            results = mt.grouped_allreduce(small + [big], op=mt.Sum, process_set=outer)
            for i, result in enumerate(results[:5]):
                expect(result, 2 + 2 * i, f"sum of small.{i} on the set {{0, 2}}")
            expect(results[5], 2, "sum of big on the set {0, 2}")
            # Open MPI's non-blocking collectives, which a process set uses, take
            # no device memory: CUDA-aware MPI is for the job-wide set only
            plan = mt.api.basics.engine().device_plan
            expect_route("GPU float32 sum", "NCCL" if plan.nccl else "staged",
                         outer.process_set_id)
        everyone = mt.allreduce(cupy.ones(10, cupy.float32), op=mt.Sum, name="everyone")
        expect(everyone, 3, "sum on the job-wide set beside a process set")
    finally:
        mt.barrier()
        mt.remove_process_set(outer)


@mpi_test(np=(2,), envs=ROUTES, skip=machine.runnable)
def test_cross_rank_errors_on_the_device():
    cupy = use_my_gpu()
    with pytest.raises(mt.MismatchError, match="mismatched shapes"):
        mt.allreduce(cupy.zeros(3 + mt.rank(), cupy.float32), name="gpu.shape")
    x = cupy.zeros(3, cupy.float32) if mt.rank() == 0 else np.zeros(3, np.float32)
    with pytest.raises(mt.MismatchError, match="mismatched devices.*rank 0: GPU"):
        mt.allreduce(x, name="gpu.or.cpu")
    expect(mt.allreduce(cupy.ones(2), op=mt.Sum), mt.size(), "sum after the errors")


SLOW_FILL = r"""
extern "C" __global__ void slow_fill(float* x, long long n, float value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (long long i = threadIdx.x; i < n; i += blockDim.x) x[i] = value;
}"""


def fill_reference(x, n, value, cycles):
    """slow_fill, but for the wait: on the simulated device it runs only when
    something waits for it, later than any real kernel could."""
    x[:n] = value


@mpi_test(np=(1, 2), envs=ROUTES, skip=machine.runnable)
def test_an_input_freed_or_written_by_a_queued_kernel_before_synchronize():
    """The handle keeps its input alive; the engine waits for kernels queued
    before the submission. (Writing to an input after submitting it, before
    synchronize() returns, is the user's error: see docs/gpu.md.)"""
    cupy = use_my_gpu()
    r, n = mt.rank(), mt.size()
    handle = mt.allreduce_async(cupy.full(1 << 16, r + 1.0, cupy.float32), op=mt.Sum)
    gc.collect()
    expect(mt.synchronize(handle), sum(range(1, n + 1)), "sum of an input dropped at once")
    slow_fill = machine.raw_kernel(SLOW_FILL, "slow_fill", fill_reference,
                                   (np.int64, np.float32, np.int64))
    for name, size in (("slow.small", 1000), ("slow.big", 1 << 20)):
        x = cupy.zeros(size, cupy.float32)
        slow_fill((1,), (256,), (x, np.int64(size), np.float32(r + 1), np.int64(200_000_000)))
        result = mt.allreduce(x, op=mt.Sum, name=name)          # submitted at once
        expect(result, sum(range(1, n + 1)), f"{name}: sum of a slowly written input", [x])


@mpi_test(np=(2,), envs=ROUTES, skip=machine.runnable)
def test_a_device_allocation_failing_on_one_rank_fails_the_allreduce_on_every_rank():
    cupy = use_my_gpu()
    r = mt.rank()
    x = cupy.ones(16 << 20, cupy.float32)             # 64 MiB
    mt.synchronize(mt.allreduce_async(x, name="oom", output=x))     # kernels, buffers
    mt.barrier()
    hog = None
    if r == 1:        # in place, rank 0 allocates nothing; rank 1 needs 64 MiB for its result
        cupy.get_default_memory_pool().free_all_blocks()
        free, _ = cupy.cuda.runtime.memGetInfo()
        hog = cupy.cuda.runtime.malloc(free - (16 << 20))
    try:
        handle = mt.allreduce_async(x, name="oom", output=x if r == 0 else None)
        with pytest.raises(mt.MpitrainInternalError) as raised:
            mt.synchronize(handle)
    finally:
        if hog is not None:
            cupy.cuda.runtime.free(hog)
    assert type(raised.value).__name__ == "GpuError"
    assert str(raised.value).startswith("allreduce of 'oom' failed: the GPU path could not "
                                        "be set up (rank 1: OutOfMemoryError")
    mt.barrier()
    expect(mt.allreduce(x, op=mt.Sum, name="oom"), 2, "sum after a failed set-up", [x])


# -- PyTorch ----------------------------------------------------------------------

def torch_device():
    use_my_gpu()
    return machine.torch_device(mt.local_rank())


def train(where, label, steps=4, **options):
    """A model trained on rank-dependent data, after and before the broadcasts."""
    import torch
    import mpitrain.torch as hvd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(),
                                torch.nn.Linear(30, 2)).to(where)
    if hvd.rank() != 0:                    # broadcast_parameters must undo this
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"{label}.{n}", p) for n, p in model.named_parameters()],
        **options)
    passes = options.get("backward_passes_per_step", 1)
    generator = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(passes):
            x = torch.randn(8, 20, generator=generator).to(where)
            (model(x).square().mean() / passes).backward()
        optimizer.step()
    if hvd.rank() != 0:                    # broadcast_optimizer_state must undo this
        for state in optimizer.state.values():
            state["momentum_buffer"].add_(1.0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return model, optimizer


@mpi_test(np=(1, 2, 3), envs=ROUTES, skip=machine.runnable)
def test_torch_cuda_training_with_overlap_fp16_and_accumulation_matches_the_cpu():
    import mpitrain.torch as hvd
    device = torch_device()
    for options in ({"overlap": True}, {"overlap": True, "backward_passes_per_step": 2},
                    {"compression": hvd.Compression.fp16}):
        with machine.host_reference():
            cpu, _ = train("cpu", "cpu", **options)
        gpu, gpu_optimizer = train(device, "gpu", **options)
        for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
            assert machine.on_gpu(q), q.device
            expect(q, p, f"{name} after training with {options}, against the CPU",
                   rtol=1e-4, atol=1e-4)
        momentum = [s["momentum_buffer"] for s in gpu_optimizer.state.values()]
        assert momentum and all(machine.on_gpu(m) for m in momentum), \
            [m.device for m in momentum]
        mine = [t.detach().cpu() for t in list(gpu.parameters()) + momentum]
        for rank, other in enumerate(hvd.allgather_object(mine)):
            for index, (a, b) in enumerate(zip(mine, other)):
                expect(a, b, f"parameter or momentum {index} with {options}, against "
                             f"rank {rank}'s")


@mpi_test(np=(1,), envs=ROUTES)
def test_torch_cuda_step_on_one_rank_is_the_plain_step():
    import torch
    import mpitrain.torch as hvd
    device = torch_device()
    torch.manual_seed(0)
    model = torch.nn.Linear(50, 50).to(device)
    plain = torch.nn.Linear(50, 50).to(device)
    plain.load_state_dict(model.state_dict())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         compression=hvd.Compression.fp16)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    # MPITRAIN_TEST_ONE_RANK_PIPELINE=1 sends even a lone rank's gradients
    # through the pipeline: fp16 on the wire, an average of one.
    moved = engine_sizes.one_rank_moves_data()
    x = torch.randn(16, 50, device=device)
    for net, opt in ((model, optimizer), (plain, plain_optimizer)):
        opt.zero_grad()
        net(x).square().mean().backward()
        if opt is plain_optimizer and moved:
            for p in net.parameters():
                p.grad = p.grad.half().float()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        expect(p, q, f"{name} after one step, against the plain optimizer's"
                     + (" on gradients rounded to fp16 (one-rank pipeline)" if moved else ""))


@mpi_test(np=(1, 2, 3), envs=ROUTES, skip=machine.runnable)
def test_torch_bfloat16_cuda_tensors_reduce_in_float32_like_the_cpu():
    import torch
    import mpitrain.torch as hvd
    device = torch_device()
    r = hvd.rank()
    values = torch.tensor([2049.0, 0.1, 65504.0 / 8, -3.3, 1e-4]) + 0.7 * r
    for dtype in (torch.bfloat16, torch.float16):
        cpu = values.to(dtype)
        gpu = cpu.clone().to(device)
        with machine.host_reference():
            want = hvd.allreduce(cpu, op=hvd.Sum, name=f"cpu.{dtype}")
            mean = hvd.allreduce(cpu, name=f"cpu.{dtype}.mean")
        got = hvd.allreduce(gpu, op=hvd.Sum, name=f"gpu.{dtype}")
        assert got.dtype == dtype and machine.on_gpu(got), (got.dtype, got.device)
        expect(got, want, f"{dtype} sum, against the CPU's", [gpu])
        hvd.allreduce_(gpu, name=f"gpu.{dtype}.in_place")
        expect(gpu, mean, f"{dtype} in-place average, against the CPU's")
    model = torch.nn.Linear(10, 4).to(device, torch.bfloat16)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    model(torch.randn(3, 10, device=device, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    weights = hvd.allgather_object(model.weight.detach().cpu())
    for rank, weight in enumerate(weights):
        expect(weight, weights[0], f"bfloat16 weight of rank {rank}, against rank 0's")


@mpi_test(np=(2, 3), envs=ROUTES, skip=machine.runnable)
def test_torch_sync_batch_norm_on_cuda_matches_the_cpu():
    import torch
    import mpitrain.torch as hvd
    device = torch_device()
    generator = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(4, 3, 5, generator=generator)
    outputs = []
    for where in ("cpu", device):
        with machine.host_reference() if where == "cpu" else contextlib.nullcontext():
            norm = hvd.SyncBatchNorm(3).to(where)
            inputs = x.clone().to(where).requires_grad_()
            out = norm(inputs)
            out.square().sum().backward()
        outputs.append((out.detach().cpu(), inputs.grad.cpu(), norm.running_mean.cpu()))
    for what, cpu, gpu in zip(("output", "input gradient", "running mean"), *outputs):
        expect(gpu, cpu, f"SyncBatchNorm's {what}, against the CPU's", rtol=1e-5, atol=1e-5)


# -- TensorFlow -------------------------------------------------------------------

@mpi_test(np=(2,), env=machine.job_env(), skip=lambda nprocs, env: machine.needs_a_real_gpu(
    "TensorFlow's GPU tensors (this TensorFlow is tensorflow-cpu)"))
def test_tensorflow_gpu_tensors():
    tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed here")
    import mpitrain.tensorflow as hvd
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("this TensorFlow sees no GPU (tensorflow-cpu)")
    with tf.device("GPU:0"):
        x = tf.fill([5], float(hvd.rank()))
        result = hvd.allreduce(x, op=hvd.Sum, name="tf.gpu")
        brain = hvd.allreduce(tf.cast(x, tf.bfloat16), op=hvd.Sum, name="tf.gpu.bf16")
    assert "GPU" in result.device
    assert np.allclose(result.numpy(), sum(range(hvd.size())))
    assert brain.dtype == tf.bfloat16
    assert np.allclose(tf.cast(brain, tf.float32).numpy(), sum(range(hvd.size())))
