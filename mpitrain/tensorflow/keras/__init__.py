"""Horovod's Keras API on mpitrain: ``import mpitrain.tensorflow.keras as hvd``.

Works with Keras 3 (TensorFlow 2.16+) and with tf_keras (TF_USE_LEGACY_KERAS=1).
"""

from mpitrain.tensorflow import (
    Adasum, Average, Compression, HorovodInternalError, Max, Min, Product, ProcessSet,
    Sum, add_process_set, allgather_object, broadcast_object, broadcast_variables,
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, global_process_set,
    gloo_built, gloo_enabled, grouped_allgather, grouped_allreduce, init,
    is_homogeneous, is_initialized, join, local_rank, local_size, mpi_built,
    mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
    rocm_built, shutdown, size, start_timeline, stop_timeline)
from mpitrain.api.checkpoint import CheckpointError
from mpitrain.tensorflow.keras import callbacks, elastic
from mpitrain.tensorflow.keras.collectives import (
    allgather, allreduce, broadcast, reducescatter)
from mpitrain.tensorflow.keras.checkpoint import load_checkpoint, save_checkpoint
from mpitrain.tensorflow.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from mpitrain.tensorflow.keras.saving import load_model
from mpitrain.tensorflow.keras.variables import broadcast_global_variables
from mpitrain import horovod_names as _horovod_names
from mpitrain.tensorflow.keras import keras2_calls as _keras2_calls

_keras2_calls.accept_horovods_compile_arguments()

_IN_TENSORFLOW = "is not in Horovod's Keras module either: use mpitrain.tensorflow's"
__getattr__ = _horovod_names.module_getattr(__name__, "horovod.tensorflow.keras", missing={
    name: _IN_TENSORFLOW for name in (
        "DistributedGradientTape", "PartialDistributedGradientTape", "alltoall",
        "grouped_reducescatter", "broadcast_", "SyncBatchNormalization")} | {
    "run": "is horovod.run, which is mpitrain.run",
    "is_version_greater_equal_than": _horovod_names.INTERNAL_HELPER,
})
