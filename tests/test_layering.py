"""The folders of mpitrain/ import only downwards, and the adapters only through the API.

docs/design.md draws the layers: the launcher and the adapters over api/,
over engine/, over transport/, over backends/ and runtime/, with the shared
vocabulary (errors, ops, horovod_names, version) under them all. An import
that runs back up ties a lower layer to a higher one's choices; an adapter
that reaches past api/ into the engine breaks whenever the engine's rooms
move. Inside torch/optimizers/ the modules are layered the same way, so that
no import circle returns there. These tests read the sources (no imports
run), so they name the file and line that crosses.
"""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpitrain")

VOCABULARY = {"errors", "ops", "horovod_names", "version", "__version__"}
# Higher numbers sit higher; a folder imports only from lower numbers. The
# package's own __init__ is the numpy users' door, level with the adapters.
# A folder or module missing here fails the test until it is given its place.
LEVELS = {"launcher": 5, "torch": 4, "tensorflow": 4, "__init__": 4, "api": 3,
          "engine": 2, "transport": 1, "backends": 0, "runtime": 0,
          **dict.fromkeys(VOCABULARY, -1)}
ADAPTERS = ("torch", "tensorflow")
# What an adapter may import besides itself: its one door, arrays, the vocabulary.
ADAPTER_DOOR = {"api", "backends"} | VOCABULARY
# Inside torch/optimizers/, as PyTorch's DDP over its Reducer: the facade
# (distributed.py) over the reducer and Adasum, over the parameter names and
# buckets; its variant local_sgd.py over it, diloco.py over that (with its
# diloco_outer.py over diloco_fragments.py). Higher imports only lower, so
# the circle distributed <-> adasum cannot come back.
OPTIMIZERS = os.path.join(PACKAGE, "torch", "optimizers")
OPTIMIZER_LEVELS = {"__init__": 5, "diloco": 4, "local_sgd": 3, "distributed": 2,
                    "reducer": 1, "adasum": 1, "diloco_outer": 1, "parameter_names": 0,
                    "buckets": 0, "sharded": 2, "sharded_stage1": 1, "sharded_stage2": 1,
                    "sharded_checks": 0, "sharded_scaling": 0, "diloco_fragments": 0}


def _sources():
    for directory, _, files in os.walk(PACKAGE):
        for file in sorted(files):
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                yield os.path.relpath(path, os.path.dirname(PACKAGE)), path


def _folder(relative):
    """'torch' for mpitrain/torch/ops.py, '__init__' for mpitrain/__init__.py."""
    parts = relative.split(os.sep)
    return parts[1] if len(parts) > 2 else os.path.splitext(parts[1])[0]


def _imported_names(tree):
    """(line, dotted name) for every import in ``tree``, inside functions too:
    ``from a.b import c`` gives a.b.c, which is c's module where c is one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def _imported_folders(tree):
    """(line, the mpitrain folder or module imported) for every import in ``tree``,
    with None for a bare ``import mpitrain``."""
    for line, name in _imported_names(tree):
        if name == "mpitrain":
            yield line, None
        elif name.startswith("mpitrain."):
            yield line, name.split(".")[1]


def _crossings(allowed):
    """'file:line imports X' for each import that ``allowed(folder, target)`` refuses."""
    found = []
    for relative, path in _sources():
        folder = _folder(relative)
        with open(path) as source:
            tree = ast.parse(source.read(), path)
        for line, target in _imported_folders(tree):
            if target != folder and not allowed(folder, target):
                found.append(f"{relative}:{line} imports "
                             + ("the whole mpitrain package" if target is None
                                else f"mpitrain.{target}"))
    return found


def test_no_import_runs_back_up_between_folders():
    def downwards(folder, target):
        return LEVELS.get(target or "__init__", 99) < LEVELS.get(folder, -99)
    assert _crossings(downwards) == []


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_adapters_enter_through_the_api_alone(adapter):
    """Not the engine, the transport or the runtime; and not ``import mpitrain``,
    whose package reaches them all."""
    def through_the_door(folder, target):
        return folder != adapter or target in ADAPTER_DOOR
    assert _crossings(through_the_door) == []


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_adapters_never_hold_the_engine_itself(adapter):
    """``basics.engine()`` hands over the engine, past the door."""
    calls = []
    for relative, path in _sources():
        if _folder(relative) != adapter:
            continue
        with open(path) as source:
            tree = ast.parse(source.read(), path)
        calls += [f"{relative}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "engine"]
    assert calls == []


def test_the_torch_optimizers_import_only_downwards():
    """Imports inside functions count: a deferred import back up is a circle too."""
    found = []
    for file in sorted(os.listdir(OPTIMIZERS)):
        if not file.endswith(".py"):
            continue
        module = file[:-len(".py")]
        with open(os.path.join(OPTIMIZERS, file)) as source:
            tree = ast.parse(source.read(), file)
        for line, name in _imported_names(tree):
            parts = name.split(".")
            if parts[:3] != ["mpitrain", "torch", "optimizers"]:
                continue
            target = parts[3] if len(parts) > 3 else "__init__"
            if OPTIMIZER_LEVELS.get(target, 99) >= OPTIMIZER_LEVELS.get(module, -99):
                found.append(f"torch/optimizers/{file}:{line} imports {target}")
    assert found == []
