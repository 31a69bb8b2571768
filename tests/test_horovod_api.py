"""Horovod 0.28.1's Python API, name by name, read from its source
(tests/horovod_api/horovod-0.28.1.json, written by extract.py there): every
name of every module a Horovod user imports exists in mpitrain's module, or
fails with a HorovodNameError saying where to go; a callable takes Horovod's
parameters in Horovod's order, with Horovod's defaults (mpitrain may add
parameters after them, with defaults); a class has Horovod's public methods
and attributes. What differs on purpose is in DIFFERENCES, each with its
reason, and in docs/migrating-from-horovod.md."""

import importlib
import inspect
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mpitrain.horovod_names import HorovodNameError
from tests.mpi_harness import ROOT, job_environment, mpi_test

HOROVOD = json.load(open(os.path.join(ROOT, "tests", "horovod_api", "horovod-0.28.1.json")))

# Horovod's module -> the mpitrain module a user imports instead (standalone
# Keras 2 users go to mpitrain.tensorflow.keras with TF_USE_LEGACY_KERAS=1).
MPITRAIN = {
    "horovod": "mpitrain",
    "horovod.torch": "mpitrain.torch",
    "horovod.torch.elastic": "mpitrain.torch.elastic",
    "horovod.tensorflow": "mpitrain.tensorflow",
    "horovod.tensorflow.elastic": "mpitrain.tensorflow.elastic",
    "horovod.tensorflow.keras": "mpitrain.tensorflow.keras",
    "horovod.tensorflow.keras.callbacks": "mpitrain.tensorflow.keras.callbacks",
    "horovod.tensorflow.keras.elastic": "mpitrain.tensorflow.keras.elastic",
    "horovod.keras": "mpitrain.tensorflow.keras",
    "horovod.keras.callbacks": "mpitrain.tensorflow.keras.callbacks",
    "horovod.keras.elastic": "mpitrain.tensorflow.keras.elastic",
}

HELPER = "absent: one of Horovod's internal helpers its module happens to import, not its API"
_TF1 = ("absent: a TF1 session helper; broadcast_variables and broadcast_object need no "
        "session")
# The one list of deliberate differences: "horovod.module.name[.method]" ->
# "absent: why" (the name fails with a HorovodNameError), "signature: why"
# (its parameters are not compared) or "behaviour: why" (same signature, a
# documented result differs). docs/migrating-from-horovod.md lists each.
_UNREGISTERED = ("behaviour: raises ValueError for a set not registered, where Horovod "
                 "returns None, which would hide the mistake")
DIFFERENCES = {
    "horovod.torch.check_extension": HELPER,
    "horovod.tensorflow.check_extension": HELPER,
    "horovod.tensorflow.check_num_rank_power_of_2": HELPER,
    "horovod.tensorflow.gpu_available": HELPER,
    "horovod.tensorflow.split_list": HELPER,
    "horovod.tensorflow.vars_to_refs": HELPER,
    "horovod.tensorflow.refs_to_vars": HELPER,
    "horovod.tensorflow.handle_average_backwards_compatibility": HELPER,
    "horovod.tensorflow.LocalGradientAggregationHelper": HELPER,
    "horovod.tensorflow.keras.is_version_greater_equal_than": HELPER,
    "horovod.tensorflow.keras.callbacks.is_version_greater_equal_than": HELPER,
    "horovod.tensorflow.BroadcastGlobalVariablesHook": _TF1,
    "horovod.tensorflow.broadcast_object_fn": _TF1,
    "horovod.tensorflow.keras.callbacks.BestModelCheckpoint": (
        "absent: made for Horovod's Spark estimator, which sets its file path; "
        "keras.callbacks.ModelCheckpoint(save_best_only=True) on rank 0 does it"),
    "horovod.keras.callbacks.BestModelCheckpoint": (
        "absent: as horovod.tensorflow.keras.callbacks.BestModelCheckpoint"),
    "horovod.keras.DistributedOptimizer": (
        "signature: standalone Keras 2's puts num_groups where horovod.tensorflow.keras "
        "has backward_passes_per_step; its users move to mpitrain.tensorflow.keras, "
        "which follows horovod.tensorflow.keras"),
    "horovod.keras.PartialDistributedOptimizer": (
        "signature: as horovod.keras.DistributedOptimizer, groups comes 9th"),
    "horovod.keras.allreduce": (
        "signature: average=True there, None in horovod.tensorflow.keras; both average"),
    **{f"{module}.ProcessSet.{method}": _UNREGISTERED
       for module in ("horovod.torch", "horovod.tensorflow", "horovod.tensorflow.keras")
       for method in ("size", "rank", "included")},
    **{f"{module}.remove_process_set": (
        "behaviour: a set not registered, or the job-wide one, raises ValueError on "
        "every rank, where Horovod returns False on that rank alone")
       for module in ("horovod.torch", "horovod.tensorflow", "horovod.tensorflow.keras")},
}

# Methods a framework calls (Keras callback hooks, a Keras layer's call,
# elastic reset hooks), not the user: mpitrain may do the work in other hooks.
FRAMEWORK_HOOK = re.compile(r"on_\w+$|call$")
# Horovod's classes whose attributes are set per object: one to look at.
SAMPLE_OBJECT = {"ProcessSet": lambda module: module.ProcessSet([0])}


def names():
    return [pytest.param(module, name, id=f"{module}.{name}")
            for module, exported in HOROVOD["modules"].items() for name in exported]


def import_mpitrain(horovod_module):
    target = MPITRAIN[horovod_module]
    if target.startswith("mpitrain.tensorflow"):
        pytest.importorskip("tensorflow")
    if target.startswith("mpitrain.torch"):
        pytest.importorskip("torch")
    return importlib.import_module(target)


def difference(qualified, kind):
    reason = DIFFERENCES.get(qualified, "")
    return reason.startswith(kind + ":")


@pytest.mark.parametrize("horovod_module,name", names())
def test_every_horovod_name_is_there_or_says_where_to_go(horovod_module, name):
    module = import_mpitrain(horovod_module)
    if difference(f"{horovod_module}.{name}", "absent"):
        assert not hasattr(module, name)
        with pytest.raises(HorovodNameError, match=f"{re.escape(name)}.* \\(docs/migrating"):
            getattr(module, name)
    else:
        assert hasattr(module, name), f"{MPITRAIN[horovod_module]} lacks Horovod's {name}"


@pytest.mark.parametrize("horovod_module", sorted(HOROVOD["modules"]))
def test_a_name_horovod_lacks_too_fails_as_usual(horovod_module):
    module = import_mpitrain(horovod_module)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'$"):
        module.no_such_name


def namespace(module):
    """Where Horovod's default texts (Compression.none, Average,
    global_process_set) are looked up: the module over its framework's."""
    framework = importlib.import_module(".".join(module.__name__.split(".")[:2]))
    return {**vars(framework), **vars(module)}


def same(a, b):
    return a is b or (type(a) is type(b) and a == b)


def compare(qualified, horovod_params, function, defaults, method=False):
    """What differs between Horovod's parameters and ``function``'s (a
    parameter Horovod requires may have a default in mpitrain)."""
    params = list(inspect.signature(function).parameters.values())[int(method):]
    kinds = {p.kind.name for p in params}
    problems = []
    positional = [p for p in horovod_params if p[1] in ("POSITIONAL_ONLY",
                                                        "POSITIONAL_OR_KEYWORD")]
    for position, (name, kind, default) in enumerate(positional):
        if position >= len(params) or params[position].name != name \
                or params[position].kind.name != kind:
            problems.append(f"parameter {position} is Horovod's {name!r}, mpitrain's "
                            f"{[p.name for p in params]}")
            break
    by_name = {p.name: p for p in params}
    for name, kind, default in horovod_params:
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if kind not in kinds:
                problems.append(f"takes no {'**' if kind == 'VAR_KEYWORD' else '*'}{name}")
            continue
        if name not in by_name:
            problems.append(f"has no {name}")
            continue
        got = by_name[name].default
        if default is not None and (got is inspect.Parameter.empty
                                    or not same(got, eval(default, dict(defaults)))):
            problems.append(f"{name}={got!r}, Horovod's {name}={default}")
    horovods = {p[0] for p in horovod_params}
    problems += [f"added parameter {p.name} has no default" for p in params
                 if p.name not in horovods and p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return [f"{qualified}: {problem}" for problem in problems]


def callables():
    return [pytest.param(module, name, record, id=f"{module}.{name}")
            for module, exported in HOROVOD["modules"].items()
            for name, record in exported.items() if record["kind"] in ("function", "class")]


@pytest.mark.parametrize("horovod_module,name,record", callables())
def test_horovods_parameters_come_in_its_order_with_its_defaults(horovod_module, name,
                                                                record):
    qualified = f"{horovod_module}.{name}"
    if difference(qualified, "absent") or difference(qualified, "signature"):
        pytest.skip(DIFFERENCES[qualified])
    module = import_mpitrain(horovod_module)
    value, defaults = getattr(module, name), namespace(module)
    problems = []
    if record["params"] is not None:
        problems += compare(qualified, record["params"], value, defaults)
    for method, params in record.get("methods", {}).items():
        where = f"{qualified}.{method}"
        if FRAMEWORK_HOOK.match(method) or difference(where, "signature"):
            continue
        if difference(where, "absent") or not hasattr(value, method):
            problems += [] if difference(where, "absent") else [f"{where} is missing"]
            continue
        static = isinstance(inspect.getattr_static(value, method), staticmethod)
        problems += compare(where, params, getattr(value, method), defaults,
                            method=not static)
    sample = SAMPLE_OBJECT.get(name, lambda module: value)(module)
    problems += [f"{qualified}.{attribute} is missing"
                 for attribute in list(record.get("attributes", {})) + record.get("properties", [])
                 if not hasattr(sample, attribute)
                 and not difference(f"{qualified}.{attribute}", "absent")]
    assert not problems, "\n".join(problems)


def test_every_difference_is_a_horovod_name_and_is_in_the_migration_guide():
    known = {f"{module}.{name}" for module, exported in HOROVOD["modules"].items()
             for name in exported}
    known |= {f"{module}.{name}.{member}" for module, exported in HOROVOD["modules"].items()
              for name, record in exported.items()
              for member in list(record.get("methods", {})) + list(record.get("attributes", {}))}
    with open(os.path.join(ROOT, "docs", "migrating-from-horovod.md")) as page:
        guide = page.read()
    for qualified, reason in DIFFERENCES.items():
        assert qualified in known, f"{qualified} is not a name of Horovod 0.28.1"
        assert reason.split(":")[0] in ("absent", "signature", "behaviour"), qualified
        parts = qualified.split(".")
        spellings = [".".join(parts[i:]) for i in range(len(parts))]   # a.b.c, b.c, c
        assert any(f"`{spelling}`" in guide for spelling in spellings), (
            f"docs/migrating-from-horovod.md does not mention {qualified}")


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


def test_horovod_run_takes_num_proc_and_horovods_deprecated_spellings():
    import mpitrain
    assert mpitrain.run(_rank_and_size, num_proc=2) == [(0, 2), (1, 2)]
    with pytest.warns(DeprecationWarning, match="use num_proc"):
        assert mpitrain.run(_rank_and_size, (), None, 1, np=3) == [(0, 3), (1, 3), (2, 3)]
    # Horovod's elastic arguments reach mpitrainrun's elastic flags, which
    # refuse --min-np without hosts to choose from before anything starts.
    with pytest.warns(DeprecationWarning, match="use min_num_proc"), \
            pytest.raises(ValueError, match="mpitrain.run: --min-np needs the hosts"):
        mpitrain.run(_rank_and_size, num_proc=2, min_np=2)


def _rank_and_size():
    import mpitrain as mt
    mt.init()
    return mt.rank(), mt.size()


def test_elastic_states_call_reset_before_the_reset_callbacks():
    from mpitrain.api.elastic import State
    calls = []

    class Counted(State):
        def reset(self):
            calls.append("reset")

    state = Counted(epoch=0)
    state.register_reset_callbacks([lambda: calls.append("callback")])
    state.on_reset()
    assert calls == ["reset", "callback"]


def test_sync_batch_normalization_refuses_fused_as_horovod_does():
    hvd = pytest.importorskip("mpitrain.tensorflow")
    for fused in (True, None):
        with pytest.raises(ValueError, match=f"does not support fused={fused}"):
            hvd.SyncBatchNormalization(fused=fused)
    assert hvd.SyncBatchNormalization(False, momentum=0.5).momentum == 0.5


@mpi_test(np=(2, 3), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=180)
def test_tensorflow_alltoall_returns_a_tensor_without_splits_and_gathers_booleans():
    import tensorflow as tf
    import mpitrain.tensorflow as hvd
    r, n = hvd.rank(), hvd.size()
    rows = tf.constant([[r, k] for k in range(n)])
    received = hvd.alltoall(rows, name="a2a.plain")
    assert isinstance(received, tf.Tensor)
    assert received.numpy().tolist() == [[k, r] for k in range(n)]
    received, splits = hvd.alltoall(rows, splits=[1] * n, name="a2a.splits")
    assert received.numpy().tolist() == [[k, r] for k in range(n)]
    assert splits.dtype == tf.int32 and splits.numpy().tolist() == [1] * n
    flags = tf.constant([r % 2 == 1] * n)
    swapped = hvd.alltoall(flags, name="a2a.bool")
    assert swapped.dtype == tf.bool
    assert swapped.numpy().tolist() == [k % 2 == 1 for k in range(n)]
    gathered = hvd.allgather(tf.constant([r == 0]), name="gather.bool")
    assert gathered.dtype == tf.bool
    assert gathered.numpy().tolist() == [k == 0 for k in range(n)]


@mpi_test(np=(2, 3), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=180)
def test_tensorflow_object_calls_take_session_before_name():
    import mpitrain.tensorflow as hvd
    r, n = hvd.rank(), hvd.size()
    assert hvd.broadcast_object({"from": r}, 1, None, "object.root") == {"from": 1}
    assert hvd.allgather_object(r * 10, None, "object.all") == [k * 10 for k in range(n)]
    with pytest.raises(ValueError, match="session=.*is for TF1 sessions"):
        hvd.broadcast_object(r, 0, session=object())
    with pytest.raises(ValueError, match="session=.*is for TF1 sessions"):
        hvd.allgather_object(r, object())


@mpi_test(np=(2, 3), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=180)
def test_broadcast_callback_leaves_local_variables_as_horovod_does():
    import keras
    import tensorflow as tf
    import mpitrain.tensorflow.keras as hvd
    r = hvd.rank()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="shared"),
                              keras.layers.Dense(1, name="mine")])
    for variable in model.variables:
        variable.assign(tf.fill(variable.shape, float(r + 1)))
    mine = model.get_layer("mine").kernel
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=mine)
    with pytest.raises(ValueError, match="a local variable must be a variable, got int"):
        callback.register_local_var(3)
    callback.set_model(model)
    callback.on_train_begin()
    assert model.get_layer("shared").kernel.numpy().tolist() == [[1.0], [1.0]]
    assert mine.numpy().tolist() == [[r + 1.0]]


@mpi_test(np=(2, 3), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=180)
def test_elastic_sampler_takes_horovods_keyword_and_the_commit_callback_commits():
    import mpitrain.torch as hvd
    import mpitrain.tensorflow.keras as hvd_keras
    sampler = hvd.elastic.ElasticSampler(list(range(12)), shuffle=False)
    sampler.record_batch(0, 2)                  # a batch of 2 on every rank
    restarted = hvd.elastic.ElasticSampler(list(range(12)), shuffle=False)
    restarted.load_state_dict(state_dict=sampler.state_dict())
    assert restarted.state_dict() == {"epoch": 0, "processed_num": 2 * hvd.size()}
    assert len(list(restarted)) == -(-(12 - 2 * hvd.size()) // hvd.size())
    state = hvd.elastic.TorchState(epoch=0)
    callback = hvd_keras.elastic.CommitStateCallback(state)
    state.epoch = 4
    callback.commit()
    state.epoch = 5
    state.restore()
    assert state.epoch == 4
