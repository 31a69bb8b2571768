"""Horovod's TensorFlow API on mpitrain: ``import mpitrain.tensorflow as hvd``.

Collectives work eagerly and inside tf.function (one op per call), with
gradients registered; DistributedGradientTape averages a custom loop's
gradients. Keras users import mpitrain.tensorflow.keras.
"""

from mpitrain import (
    Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet, Sum,
    add_process_set, allgather_object, broadcast_object, ccl_built, cross_rank,
    cross_size, cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled,
    init, is_homogeneous, is_initialized, join, local_rank, local_size, mpi_built,
    mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
    rocm_built, shutdown, size, start_timeline, stop_timeline)
from mpitrain.tensorflow.allgather import allgather, grouped_allgather
from mpitrain.tensorflow.allreduce import allreduce, grouped_allreduce
from mpitrain.tensorflow.alltoall import alltoall
from mpitrain.tensorflow.broadcast import broadcast, broadcast_, broadcast_variables
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.errors import MismatchError
from mpitrain.tensorflow.gradient_tape import (
    DistributedGradientTape, PartialDistributedGradientTape)
from mpitrain.tensorflow.graph_op import XlaNotSupportedError
from mpitrain.tensorflow.optimizer import DistributedOptimizer
from mpitrain.tensorflow.reducescatter import grouped_reducescatter, reducescatter
from mpitrain.tensorflow.sync_batch_norm import SyncBatchNormalization
