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
from mpitrain.api.handles import poll, synchronize
from mpitrain.api.objects import allgather_object, broadcast_object
from mpitrain.api.process_sets import ProcessSet, global_process_set
from mpitrain.api.set_registry import add_process_set, remove_process_set
from mpitrain.errors import (
    HorovodInternalError, MismatchError, MpitrainInternalError, ShutdownError)
from mpitrain.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from mpitrain.version import __version__
from mpitrain import horovod_names as _horovod_names

__getattr__ = _horovod_names.module_getattr(__name__, "horovod", lazy={
    "run": ("mpitrain.launcher.function", "run"),
}, missing={
    "keras": "(standalone Keras 2) is not provided: use mpitrain.tensorflow.keras, "
             "with TF_USE_LEGACY_KERAS=1 for tf_keras",
    "mxnet": "is not provided: mpitrain adapts PyTorch, TensorFlow and numpy",
    "spark": "is not provided: start the job with mpitrainrun or mpitrain.run",
    "ray": "is not provided: start the job with mpitrainrun or mpitrain.run",
    "runner": "is not provided: mpitrain.run is horovod.run, and mpitrainrun horovodrun",
})
