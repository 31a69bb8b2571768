"""The GPU path: CuPy arrays, torch CUDA tensors, TensorFlow GPU tensors.

Skipped where CuPy finds no CUDA device. On a GPU machine these run the same
checks as the CPU tests: fused and lone allreduces, float16 accumulated in
float32, staging through the host, NCCL, the other collectives, cross-rank
errors. Ranks share the machine's GPUs round-robin by local rank.
"""

import numpy as np
import pytest

import mpitrain as mt
from mpitrain import arrays
from tests.mpi_harness import mpi_test

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    arrays.cupy() is None,
    reason="no CUDA device: CuPy is not installed (pip install mpitrain[gpu]) "
           "or finds no GPU")]


def use_my_gpu():
    cupy = arrays.cupy()
    cupy.cuda.Device(mt.local_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


def fused_and_alone_sums():
    cupy = use_my_gpu()
    r, n = mt.rank(), mt.size()
    small = [cupy.full(1000 + i, r + i, cupy.float32) for i in range(20)]
    big = cupy.full(3 * 1024 * 1024, r + 1, cupy.float32)        # reduced alone
    half = cupy.full(500, 0.1 * (r + 1), cupy.float16)            # float32 on the wire
    handles = [mt.allreduce_async(a, name=f"small.{i}", op=mt.Sum)
               for i, a in enumerate(small)]
    handles.append(mt.allreduce_async(big, name="big"))
    handles.append(mt.allreduce_async(half, name="half", op=mt.Sum))
    results = [mt.synchronize(h) for h in handles]
    for i, result in enumerate(results[:20]):
        assert isinstance(result, cupy.ndarray)
        assert (result == sum(k + i for k in range(n))).all()
    assert (results[20] == sum(k + 1 for k in range(n)) / n).all()
    exact = sum(np.float32(np.float16(0.1 * (k + 1))) for k in range(n))
    assert (results[21].get() == np.float16(exact)).all()


@mpi_test(np=(2, 3))
def test_cupy_allreduce_through_the_default_path():
    fused_and_alone_sums()


@mpi_test(np=(2,), env={"MPITRAIN_CUDA_AWARE": "0"})
def test_cupy_allreduce_staged_through_host_memory():
    fused_and_alone_sums()


@mpi_test(np=(2,), env={"MPITRAIN_GPU_OPERATIONS": "nccl"})
def test_cupy_allreduce_over_nccl():
    fused_and_alone_sums()


@mpi_test(np=(2,))
def test_in_place_average_and_the_other_collectives_on_the_device():
    cupy = use_my_gpu()
    r, n = mt.rank(), mt.size()
    grads = [cupy.full((30, 7), float(r), cupy.float32) for _ in range(3)]
    handles = [mt.allreduce_async(g, name=f"grad.{i}", output=g) for i, g in enumerate(grads)]
    for handle, g in zip(handles, grads):
        assert mt.synchronize(handle) is g and (g == sum(range(n)) / n).all()
    gathered = mt.allgather(cupy.full((r + 1, 2), r, cupy.int32))
    assert isinstance(gathered, cupy.ndarray) and gathered.shape == (sum(range(1, n + 1)), 2)
    assert (mt.broadcast(cupy.full(4, r, cupy.float64), root_rank=1) == 1).all()
    rows, received = mt.alltoall(cupy.arange(2 * n, dtype=cupy.float32))
    assert rows.shape == (2 * n,) and list(received) == [2] * n
    part = mt.reducescatter(cupy.ones((n, 3), cupy.float32), op=mt.Sum)
    assert part.shape == (1, 3) and (part == n).all()


@mpi_test(np=(2,))
def test_cross_rank_errors_on_the_device():
    cupy = use_my_gpu()
    with pytest.raises(mt.MismatchError, match="mismatched shapes"):
        mt.allreduce(cupy.zeros(3 + mt.rank(), cupy.float32), name="gpu.shape")
    x = cupy.zeros(3, cupy.float32) if mt.rank() == 0 else np.zeros(3, np.float32)
    with pytest.raises(mt.MismatchError, match="mismatched devices.*rank 0: GPU"):
        mt.allreduce(x, name="gpu.or.cpu")
    assert (mt.allreduce(cupy.ones(2), op=mt.Sum) == mt.size()).all()


@mpi_test(np=(2,))
def test_torch_cuda_training_matches_the_cpu():
    import torch
    import mpitrain.torch as hvd
    use_my_gpu()
    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    for where in ("cpu", device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(),
                                    torch.nn.Linear(30, 2)).to(where)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=[(f"{where}.{n}", p) for n, p in model.named_parameters()])
        generator = torch.Generator().manual_seed(hvd.rank())
        for _ in range(3):
            x = torch.randn(8, 20, generator=generator).to(where)
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        results[str(where)] = [p.detach().cpu() for p in model.parameters()]
    for cpu, gpu in zip(*results.values()):
        assert torch.allclose(cpu, gpu, atol=1e-5)


@mpi_test(np=(2,))
def test_tensorflow_gpu_tensors():
    tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed here")
    import mpitrain.tensorflow as hvd
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("this TensorFlow sees no GPU (tensorflow-cpu)")
    with tf.device("GPU:0"):
        x = tf.fill([5], float(hvd.rank()))
        result = hvd.allreduce(x, op=hvd.Sum, name="tf.gpu")
    assert "GPU" in result.device
    assert np.allclose(result.numpy(), sum(range(hvd.size())))
