"""Horovod's TensorFlow API on mpitrain: ``import mpitrain.tensorflow as hvd``.

Collectives work eagerly and inside tf.function (one op per call), with
gradients registered; DistributedGradientTape averages a custom loop's
gradients. Keras users import mpitrain.tensorflow.keras.
"""

from mpitrain.api.array_ops import join
from mpitrain.api.basics import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
    gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
    mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
    shutdown, size, start_timeline, stop_timeline)
from mpitrain.api.process_sets import ProcessSet, global_process_set
from mpitrain.api.set_registry import add_process_set, remove_process_set
from mpitrain.errors import HorovodInternalError
from mpitrain.ops import Adasum, Average, Max, Min, Product, Sum
from mpitrain.tensorflow.allgather import allgather, grouped_allgather
from mpitrain.tensorflow.allreduce import allreduce, grouped_allreduce
from mpitrain.tensorflow.alltoall import alltoall
from mpitrain.tensorflow.broadcast import (
    broadcast, broadcast_, broadcast_global_variables, broadcast_variables)
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.errors import MismatchError
from mpitrain.tensorflow.gradient_tape import (
    DistributedGradientTape, PartialDistributedGradientTape)
from mpitrain.tensorflow.graph_op import XlaNotSupportedError
from mpitrain.tensorflow.objects import allgather_object, broadcast_object
from mpitrain.tensorflow.optimizer import DistributedOptimizer
from mpitrain.tensorflow.rank_ops import (
    local_rank_op, local_size_op, process_set_included_op, rank_op, size_op)
from mpitrain.tensorflow.reducescatter import grouped_reducescatter, reducescatter
from mpitrain.tensorflow.sync_batch_norm import SyncBatchNormalization
from mpitrain import horovod_names as _horovod_names

__getattr__ = _horovod_names.module_getattr(__name__, "horovod.tensorflow", lazy={
    "elastic": ("mpitrain.tensorflow.elastic", None),
}, missing={
    "BroadcastGlobalVariablesHook": "is a TF1 session hook: use broadcast_variables",
    "broadcast_object_fn": "is for TF1 sessions: use broadcast_object",
    "mpi_ops": "is not a module here: its functions are in mpitrain.tensorflow itself",
    "run": "is horovod.run, which is mpitrain.run",
} | dict.fromkeys((
    "check_extension", "check_num_rank_power_of_2", "gpu_available", "split_list",
    "vars_to_refs", "refs_to_vars", "handle_average_backwards_compatibility",
    "LocalGradientAggregationHelper"), _horovod_names.INTERNAL_HELPER))
from mpitrain.tensorflow import keras2_variables as _keras2_variables

_keras2_variables.make_optimizer_variables_callable()
