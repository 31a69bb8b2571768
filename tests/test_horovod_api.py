"""Horovod's documented signatures (release 0.28.1), name by name: for every
name mpitrain provides, the parameters Horovod documents come in Horovod's
order with Horovod's defaults (mpitrain may add parameters after them, with
defaults). Horovod names mpitrain lacks fail with an AttributeError that
says where to go; importing mpitrain does not load mpitrain.run's machinery."""

import ast
import importlib
import inspect
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.mpi_harness import job_environment, mpi_test

TORCH = """
init(comm=None, process_sets=None)
shutdown()
size()
rank()
local_rank()
local_size()
cross_rank()
cross_size()
is_initialized()
allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)
allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)
allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)
allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)
grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)
grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set)
allgather(tensor, name=None, process_set=global_process_set)
allgather_async(tensor, name=None, process_set=global_process_set)
broadcast(tensor, root_rank, name=None, process_set=global_process_set)
broadcast_async(tensor, root_rank, name=None, process_set=global_process_set)
broadcast_(tensor, root_rank, name=None, process_set=global_process_set)
broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set)
alltoall(tensor, splits=None, name=None, process_set=global_process_set)
reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0)
join(device=-1)
barrier(process_set=global_process_set)
poll(handle)
synchronize(handle)
broadcast_parameters(params, root_rank, process_set=global_process_set)
broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set)
broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set)
allgather_object(obj, name=None, process_set=global_process_set)
DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False, process_set=global_process_set)
SyncBatchNorm(num_features, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
ProcessSet(ranks_or_comm)
add_process_set(process_set)
remove_process_set(process_set)
elastic.TorchState(model=None, optimizer=None, **kwargs)
elastic.ElasticSampler(dataset, shuffle=True, seed=0)
elastic.run(func)
"""

TENSORFLOW = """
init(comm=None, process_sets=None)
allreduce(tensor, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set, ignore_name_scope=False)
grouped_allreduce(tensors, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, ignore_name_scope=False)
allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set)
broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set)
alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set)
reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None, process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0)
join()
broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False)
broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set)
allgather_object(obj, name=None, process_set=global_process_set)
DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none, sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True)
DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='', device_sparse='', compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True)
elastic.TensorFlowKerasState(model, optimizer=None, backend=None, **kwargs)
elastic.TensorFlowState(variables=None, session=None, **kwargs)
elastic.run(func)
"""

KERAS = """
init(comm=None, process_sets=None)
allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None, compression=Compression.none)
allgather(value, name=None)
broadcast(value, root_rank, name=None)
reducescatter(value, name=None, op=Average)
broadcast_global_variables(root_rank)
load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none)
DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True)
callbacks.BroadcastGlobalVariablesCallback(root_rank, device='', local_variables=None)
callbacks.MetricAverageCallback(device='')
callbacks.LearningRateScheduleCallback(initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True, momentum_correction=True, steps_per_epoch=None)
callbacks.LearningRateWarmupCallback(initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0)
elastic.KerasState(model, optimizer=None, backend=None, **kwargs)
elastic.CommitStateCallback(state, batches_per_commit=1)
elastic.UpdateBatchStateCallback(state)
elastic.UpdateEpochStateCallback(state)
"""

HOROVOD = """
run(func, args=(), kwargs=None, np=1, min_np=None, max_np=None, slots=None, reset_limit=None, cooldown_range=None, hosts=None, hostfile=None, start_timeout=None, ssh_port=None, ssh_identity_file=None, disable_cache=None, output_filename=None, verbose=None, use_gloo=None, use_mpi=None, mpi_args=None, network_interface=None, executable=None)
"""

MODULES = {"mpitrain.torch": TORCH, "mpitrain.tensorflow": TENSORFLOW,
           "mpitrain.tensorflow.keras": KERAS, "mpitrain": HOROVOD}
FRAMEWORK = {"mpitrain.torch": "torch", "mpitrain.tensorflow": "tensorflow",
             "mpitrain.tensorflow.keras": "tensorflow"}


def documented(module_name):
    """[(dotted name, [(parameter, kind, default text or None)])] of the table."""
    entries = []
    for line in MODULES[module_name].strip().splitlines():
        dotted, _, rest = line.partition("(")
        call = ast.parse(f"def f({rest[:-1]}): pass").body[0].args
        defaults = [None] * (len(call.args) - len(call.defaults)) + call.defaults
        params = [(arg.arg, "positional", default and ast.unparse(default))
                  for arg, default in zip(call.args, defaults)]
        if call.kwarg:
            params.append((call.kwarg.arg, "keywords", None))
        entries.append(pytest.param(module_name, dotted, params, id=f"{module_name}.{dotted}"))
    return entries


def resolve(module, dotted):
    value = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def same(a, b):
    return a is b or (type(a) is type(b) and a == b)


@pytest.mark.parametrize("module_name,dotted,horovod",
                         [entry for name in MODULES for entry in documented(name)])
def test_horovods_parameters_come_in_its_order_with_its_defaults(module_name, dotted,
                                                                horovod):
    if module_name in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[module_name])
    module = importlib.import_module(module_name)
    params = list(inspect.signature(resolve(module, dotted)).parameters.values())
    namespace = vars(module)
    for position, (name, kind, default) in enumerate(horovod):
        if kind == "keywords":
            assert any(p.kind is p.VAR_KEYWORD for p in params), f"{dotted}: no **{name}"
            continue
        assert position < len(params) and params[position].name == name, (
            f"{dotted}: Horovod's parameter {position} is {name!r}, mpitrain's "
            f"{[p.name for p in params]}")
        got = params[position].default
        if default is None:
            assert got is inspect.Parameter.empty, f"{dotted}: {name} has a default"
        else:
            expected = eval(default, dict(namespace))
            assert same(got, expected), f"{dotted}: {name}={got!r}, Horovod's {default}"
    for extra in params[len([p for p in horovod if p[1] == "positional"]):]:
        assert (extra.default is not inspect.Parameter.empty
                or extra.kind in (extra.VAR_KEYWORD, extra.VAR_POSITIONAL)), (
            f"{dotted}: mpitrain's added parameter {extra.name} needs a default")


MISSING = [("mpitrain", "spark", "start the job with mpitrainrun or mpitrain.run"),
           ("mpitrain.torch", "mpi_ops", "its functions are in mpitrain.torch itself"),
           ("mpitrain.tensorflow", "rank_op", "rank() and size() are constants"),
           ("mpitrain.tensorflow", "BroadcastGlobalVariablesHook", "use broadcast_variables"),
           ("mpitrain.tensorflow.keras", "DistributedGradientTape",
            "use mpitrain.tensorflow's")]


@pytest.mark.parametrize("module_name,name,where", MISSING)
def test_a_missing_horovod_name_says_where_its_equivalent_is(module_name, name, where):
    if module_name in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[module_name])
    module = importlib.import_module(module_name)
    assert not hasattr(module, name)
    with pytest.raises(AttributeError, match=re.escape(where)):
        getattr(module, name)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'$"):
        module.no_such_name


def test_importing_mpitrain_loads_neither_mpitrain_run_nor_tensorflow_elastic():
    check = ("import sys, mpitrain; "
             "print(sorted(m for m in ('cloudpickle', 'mpitrain.launcher.function') "
             "if m in sys.modules)); "
             "import mpitrain.tensorflow; print('mpitrain.tensorflow.elastic' in sys.modules); "
             "mpitrain.run, mpitrain.tensorflow.elastic.run; "
             "print('mpitrain.tensorflow.elastic' in sys.modules)")
    job = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         env=job_environment({"TF_CPP_MIN_LOG_LEVEL": "2"}),
                         timeout=120)
    assert job.stdout.split() == ["[]", "False", "True"], job.stderr


@mpi_test(np=(2, 3), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=180)
def test_the_keras_collectives_take_a_value_and_the_name_second():
    import mpitrain.tensorflow.keras as hvd
    r, n = hvd.rank(), hvd.size()
    mean = hvd.allreduce(np.array([r, 2 * r], np.float32), "keras.mean")
    assert np.allclose(mean.numpy(), [(n - 1) / 2, n - 1])
    assert hvd.allreduce(float(r), "keras.scalar", op=hvd.Sum).numpy() == sum(range(n))
    gathered = hvd.allgather(np.full((1, 2), r, np.int32), "keras.gather")
    assert gathered.numpy().tolist() == [[k, k] for k in range(n)]
    assert hvd.broadcast(np.int64(r + 5), 1, "keras.root").numpy() == 6
    part = hvd.reducescatter(np.ones((n, 2), np.float32) * r, "keras.scatter", hvd.Sum)
    assert part.numpy().tolist() == [[sum(range(n))] * 2]
