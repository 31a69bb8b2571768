"""Horovod's PyTorch API on mpitrain: ``import mpitrain.torch as hvd``."""

from mpitrain.api.array_ops import barrier
from mpitrain.api.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
    gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
    mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
    shutdown, size, start_timeline, stop_timeline)
from mpitrain.api.checkpoint import CheckpointError
from mpitrain.api.handles import poll, synchronize
from mpitrain.api.objects import allgather_object, broadcast_object
from mpitrain.api.process_sets import ProcessSet, global_process_set
from mpitrain.api.set_registry import add_process_set, remove_process_set
from mpitrain.errors import (
    HorovodInternalError, MismatchError, MpitrainInternalError, ShutdownError)
from mpitrain.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from mpitrain.torch.autograd import (
    allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
    grouped_reducescatter, reducescatter)
from mpitrain.torch import distributed as _distributed  # registers the "mpitrain" backend
from mpitrain.torch import elastic
from mpitrain.torch.checkpoint import load_checkpoint, save_checkpoint
from mpitrain.torch.compression import Compression
from mpitrain.torch.functions import broadcast_optimizer_state, broadcast_parameters
from mpitrain.torch.ops import (
    allgather_async, allreduce_, allreduce_async, allreduce_async_, alltoall_async,
    broadcast_, broadcast_async, broadcast_async_, grouped_allgather_async,
    grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
    grouped_reducescatter_async, join, reducescatter_async, sparse_allreduce_async)
from mpitrain.torch.optimizers import (
    DiLoCoOptimizer, DistributedOptimizer, LocalSGDOptimizer, ShardedOptimizer)
from mpitrain.torch.sync_batch_norm import SyncBatchNorm
from mpitrain.version import __version__
from mpitrain import horovod_names as _horovod_names

__getattr__ = _horovod_names.module_getattr(__name__, "horovod.torch", missing={
    "mpi_ops": "is not a module here: its functions are in mpitrain.torch itself",
    "run": "is horovod.run, which is mpitrain.run",
    "check_extension": _horovod_names.INTERNAL_HELPER,
})
