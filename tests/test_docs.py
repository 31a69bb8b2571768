"""The docs say what the code does: the Horovod migration tables name every
public name of Horovod's modules and tell truly whether mpitrain has it, and
the configuration page lists every variable and launcher flag."""

import importlib
import inspect
import os
import re

import pytest

from mpitrain.launcher import run
from mpitrain.runtime import config
from tests.mpi_harness import ROOT

# The public API of Horovod 0.28.1 (its modules' imports and definitions,
# without the helpers they import for themselves).
HOROVOD = {
    "horovod.torch": """
        elastic Compression allgather_object broadcast_object broadcast_optimizer_state
        broadcast_parameters allreduce allreduce_async allreduce_ allreduce_async_
        grouped_allreduce grouped_allreduce_async grouped_allreduce_ grouped_allreduce_async_
        sparse_allreduce_async allgather allgather_async grouped_allgather
        grouped_allgather_async broadcast broadcast_async broadcast_ broadcast_async_
        alltoall alltoall_async reducescatter reducescatter_async grouped_reducescatter
        grouped_reducescatter_async join barrier poll synchronize init shutdown
        is_initialized start_timeline stop_timeline size local_size cross_size rank
        local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled
        gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet
        global_process_set add_process_set remove_process_set Average Sum Adasum Min Max
        Product HorovodInternalError DistributedOptimizer SyncBatchNorm""",
    "horovod.tensorflow": """
        elastic Compression allgather_object broadcast_object broadcast_object_fn
        broadcast_variables allgather grouped_allgather broadcast broadcast_ alltoall init
        shutdown is_initialized start_timeline stop_timeline size local_size cross_size
        rank local_rank cross_rank is_homogeneous rank_op local_rank_op size_op
        local_size_op process_set_included_op mpi_threads_supported mpi_enabled mpi_built
        gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built
        ProcessSet global_process_set add_process_set remove_process_set Average Sum
        Adasum Min Max Product join SyncBatchNormalization allreduce reducescatter
        grouped_allreduce grouped_reducescatter broadcast_global_variables
        BroadcastGlobalVariablesHook DistributedOptimizer DistributedGradientTape
        PartialDistributedGradientTape""",
    "horovod.tensorflow.keras": """
        init shutdown is_initialized start_timeline stop_timeline size local_size
        cross_size rank local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built
        gloo_enabled gloo_built ProcessSet global_process_set add_process_set
        remove_process_set nccl_built ddl_built ccl_built cuda_built rocm_built Average
        Sum Compression callbacks elastic DistributedOptimizer PartialDistributedOptimizer
        broadcast_global_variables
        allreduce allgather broadcast reducescatter load_model
        callbacks.BroadcastGlobalVariablesCallback callbacks.MetricAverageCallback
        callbacks.LearningRateScheduleCallback callbacks.LearningRateWarmupCallback
        callbacks.BestModelCheckpoint""",
}


def read(name):
    return open(os.path.join(ROOT, "docs", name)).read()


def migration_tables():
    """{(horovod module, mpitrain module): {name: 'yes' or 'no'}}."""
    tables = {}
    sections = re.split(r"^### ", read("migrating-from-horovod.md"), flags=re.M)
    for section in sections:
        heading = re.match(r"`(horovod[\w.]*)` → `(mpitrain[\w.]*)`", section)
        if not heading:
            continue
        rows = {}
        for line in section.splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[1] in ("yes", "no"):
                for name in re.findall(r"`([\w.]+)`", cells[0]):
                    assert name not in rows, f"{name} is listed twice"
                    rows[name] = cells[1]
        tables[heading.groups()] = rows
    return tables


def has(module, dotted):
    value = module
    for part in dotted.split("."):
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True


def test_the_migration_tables_cover_every_horovod_module():
    assert {horovod for horovod, _ in migration_tables()} == set(HOROVOD)


@pytest.mark.parametrize("horovod", sorted(HOROVOD))
def test_the_migration_table_names_every_horovod_name(horovod):
    (rows,) = [rows for (name, _), rows in migration_tables().items() if name == horovod]
    assert set(rows) == set(HOROVOD[horovod].split())


@pytest.mark.parametrize("horovod", sorted(HOROVOD))
def test_the_migration_table_tells_what_mpitrain_has(horovod):
    ((_, target), rows), = [(key, rows) for key, rows in migration_tables().items()
                             if key[0] == horovod]
    if target.startswith("mpitrain.tensorflow"):
        pytest.importorskip("tensorflow")
    if target == "mpitrain.torch":
        pytest.importorskip("torch")
    module = importlib.import_module(target)
    wrong = {name: status for name, status in rows.items()
             if has(module, name) != (status == "yes")}
    assert not wrong, f"the table says the opposite of {target} for {wrong}"


def test_every_variable_has_its_default_in_the_configuration_page():
    page = read("configuration.md")
    rows = {re.match(r"\| `(MPITRAIN_\w+)` \|", line).group(1)
            for line in page.splitlines() if re.match(r"\| `MPITRAIN_\w+` \|", line)}
    assert rows == set(config.variable_names())


def test_every_launcher_flag_is_in_the_configuration_page():
    page = read("configuration.md")
    flags = [flag for action in run.build_parser()._actions
             for flag in action.option_strings if flag not in ("-h", "--help")]
    missing = [flag for flag in flags if f"`{flag}" not in page]
    assert not missing


def test_the_security_page_names_every_public_call_that_unpickles_other_ranks_objects():
    unpickling = re.compile(r"\b(broadcast_object|allgather_object|read_on_root)\(")
    found = set()
    for module_name in ("mpitrain", "mpitrain.torch", "mpitrain.tensorflow",
                        "mpitrain.tensorflow.keras"):
        module = importlib.import_module(module_name)
        for name in dir(module):
            value = getattr(module, name)
            if name.startswith("_") or not inspect.isfunction(value) \
                    or not value.__module__.startswith("mpitrain"):
                continue
            if name in ("broadcast_object", "allgather_object") \
                    or unpickling.search(inspect.getsource(value)):
                found.add(name)
    assert {"broadcast_object", "allgather_object", "broadcast_optimizer_state",
            "load_checkpoint"} <= found, found
    with open(os.path.join(ROOT, "docs", "security.md")) as page:
        text = page.read()
    assert not [name for name in found if f"`{name}`" not in text]
