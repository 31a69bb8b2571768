"""mpitrain: Horovod-style data-parallel training on MPI, for several frameworks.

``import mpitrain as mt`` gives the framework-neutral API on numpy arrays;
``mpitrain.torch`` and ``mpitrain.tensorflow`` adapt it to the frameworks.
"""

from mpitrain.api.array_ops import (
    allgather, allgather_async, allreduce, allreduce_async, alltoall,
    alltoall_async, barrier, broadcast, broadcast_async, grouped_allgather,
    grouped_allgather_async, grouped_allreduce, grouped_allreduce_async,
    grouped_reducescatter, grouped_reducescatter_async, join, reducescatter,
    reducescatter_async)
from mpitrain.api.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
    gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
    mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
    shutdown, size, start_timeline, stop_timeline)
from mpitrain.api.objects import allgather_object, broadcast_object
from mpitrain.api.process_sets import ProcessSet, global_process_set
from mpitrain.api.set_registry import add_process_set, remove_process_set
from mpitrain.engine.handles import poll, synchronize
from mpitrain.errors import (
    HorovodInternalError, MismatchError, MpitrainInternalError, ShutdownError)
from mpitrain.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from mpitrain.version import __version__
