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
from tests.test_horovod_api import DIFFERENCES, HELPER, HOROVOD as HOROVOD_API

# Each migration table covers a Horovod module's names, and those of the
# submodules named here with their prefix ("callbacks.MetricAverageCallback").
TABLES = {
    "horovod.torch": {"horovod.torch": ""},
    "horovod.tensorflow": {"horovod.tensorflow": ""},
    "horovod.tensorflow.keras": {"horovod.tensorflow.keras": "",
                                 "horovod.tensorflow.keras.callbacks": "callbacks."},
}


def horovod_names(table):
    """The names of Horovod 0.28.1 (tests/horovod_api) that ``table`` must list:
    all but the internal helpers its modules import, which the guide's prose
    names (test_horovod_api checks that)."""
    names = set()
    for module, prefix in TABLES[table].items():
        names |= {prefix + name for name in HOROVOD_API["modules"][module]
                  if DIFFERENCES.get(f"{module}.{name}") != HELPER}
    return names


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
    assert {horovod for horovod, _ in migration_tables()} == set(TABLES)


@pytest.mark.parametrize("horovod", sorted(TABLES))
def test_the_migration_table_names_every_horovod_name(horovod):
    (rows,) = [rows for (name, _), rows in migration_tables().items() if name == horovod]
    assert set(rows) == horovod_names(horovod)


@pytest.mark.parametrize("horovod", sorted(TABLES))
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
