"""mpitrain.torch offers horovod.torch's names; compression works locally."""

import torch

import mpitrain.torch as hvd

HOROVOD_TORCH_NAMES = """
    Adasum Average Compression DistributedOptimizer HorovodInternalError Max Min
    ProcessSet Product Sum SyncBatchNorm add_process_set allgather allgather_async
    allgather_object allreduce allreduce_ allreduce_async allreduce_async_ alltoall
    alltoall_async barrier broadcast broadcast_ broadcast_async broadcast_async_
    broadcast_object broadcast_optimizer_state broadcast_parameters ccl_built
    cross_rank cross_size cuda_built ddl_built gloo_built gloo_enabled
    global_process_set grouped_allgather grouped_allgather_async grouped_allreduce
    grouped_allreduce_ grouped_allreduce_async grouped_allreduce_async_
    grouped_reducescatter grouped_reducescatter_async init is_initialized join
    local_rank local_size mpi_built mpi_enabled mpi_threads_supported nccl_built poll
    rank reducescatter reducescatter_async remove_process_set rocm_built shutdown
    size sparse_allreduce_async start_timeline stop_timeline synchronize
""".split()


def test_every_horovod_torch_name_exists():
    missing = [name for name in HOROVOD_TORCH_NAMES if not hasattr(hvd, name)]
    assert not missing
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_compression_casts_floats_for_the_wire_and_back():
    x = torch.linspace(-3.0, 3.0, 7)
    for compressor, wire in ((hvd.Compression.fp16, torch.float16),
                             (hvd.Compression.bf16, torch.bfloat16)):
        sent, ctx = compressor.compress(x)
        assert sent.dtype == wire
        back = compressor.decompress(sent, ctx)
        assert back.dtype == torch.float32
        torch.testing.assert_close(back, x, rtol=1e-2, atol=0)
        ints = torch.arange(3)
        sent, ctx = compressor.compress(ints)
        assert sent is ints and compressor.decompress(sent, ctx) is ints
    sent, ctx = hvd.Compression.none.compress(x)
    assert sent is x and hvd.Compression.none.decompress(sent, ctx) is x
