"""The simulated CuPy offers nothing that CuPy lacks and takes no call that CuPy refuses.

The GPU tests run mpitrain on devtools/simulated_cupy, a stand-in for the part
of CuPy that mpitrain uses. If the stand-in had a name, a parameter or an
attribute that CuPy has not, code written against it would pass those tests and
fail on the first GPU. These tests compare the stand-in, built without
installing it (``_modules()``), with the CuPy installed here:

- every public name of the stand-in's cupy, cupy.cuda, cupy.cuda.memory and
  cupy.cuda.runtime exists in CuPy's module of that name; a constant has CuPy's
  value; a submodule is there after a plain ``import cupy``;
- every function and constructor takes no call that CuPy's refuses: each
  positional parameter has CuPy's name at its place, each parameter that can be
  given by keyword is one of CuPy's keywords, each parameter CuPy requires is
  required, and a default is CuPy's where both can be read;
- every public member of the stand-in's classes, and of the objects it hands
  out (kernels, pinned memory, the memory pool, an array's flags), exists on
  CuPy's class, a method where CuPy's is a method and a value where CuPy's is a
  value (an array's .data.ptr, .data.mem.ptr, .device.id, .flags.c_contiguous),
  and takes no call CuPy's refuses;
- cupy.cuda.nccl: CuPy loads it only with libnccl, which a machine without a
  GPU lacks, so the stand-in's names and signatures are compared with the
  strings of CuPy's compiled module, and its constants with NCCL's nccl.h.

Most of CuPy is Cython: where ``inspect.signature`` cannot read a function,
the signature Cython embeds as the first line of its docstring is read
instead, its C types dropped. CuPy's plain-Python classes set some attributes
in ``__init__``, which mostly needs a GPU: those their docstrings document, and
those of the instances made without one, count as CuPy's. CuPy is needed (CI
installs it for these tests); the tests that need it skip without it.
"""

import ast
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import types
import warnings

import pytest

from devtools import simulated_cupy
from devtools.simulated_cupy import functions, kernels, memory, nccl
from devtools.simulated_cupy.ndarray import _Flags

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
BY_KEYWORD = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
# Class dunders that are bookkeeping, not API (__init__ is compared as the constructor).
BOOKKEEPING = {"__init__", "__module__", "__doc__", "__dict__", "__weakref__", "__del__",
               "__slots__", "__qualname__", "__firstlineno__", "__static_attributes__"}
ON_SELF = "an attribute its methods set on self"

MODULES = ("cupy", "cupy.cuda", "cupy.cuda.memory", "cupy.cuda.runtime")
# Classes of objects the stand-in hands out without offering the class by name:
# (where they come from, the stand-in's class, CuPy's module and class).
HANDED_OUT = [
    ("cupy.RawModule.get_function()", kernels.Function, "cupy.cuda.function", "Function"),
    ("cupy.cuda.alloc_pinned_memory()", memory._pinned_type(1), "cupy.cuda",
     "PinnedMemoryPointer"),
    ("cupy.get_default_memory_pool()", type(functions.get_default_memory_pool()), "cupy.cuda",
     "MemoryPool"),
    ("cupy.ndarray.flags", _Flags, "cupy._core.flags", "Flags"),
]
# NCCL's enums ncclDataType_t and ncclRedOp_t in nccl.h (NVIDIA/nccl,
# src/nccl.h.in), by the names of cupy.cuda.nccl's constants.
NCCL_H = {"NCCL_INT8": 0, "NCCL_CHAR": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_INT": 2,
          "NCCL_UINT32": 3, "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6,
          "NCCL_HALF": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT": 7, "NCCL_FLOAT64": 8,
          "NCCL_DOUBLE": 8, "NCCL_BFLOAT16": 9,
          "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}
# A signature Cython embeds: "memcpyAsync(intptr_t dst, ...)", "Stream.use(self)",
# "alloc_pinned_memory(size_t size) -> PinnedMemoryPointer".
EMBEDDED = re.compile(r"(?:[\w.]+\.)?(?P<name>\w+)\((?P<parameters>.*)\)(?:\s*->.*)?")
# What a plain `import cupy` reaches, run in a process of its own: this one may
# have imported more.
REACHABLE = """
import sys, warnings
warnings.simplefilter("ignore")
import cupy
for path in sys.argv[1:]:
    module = cupy
    for name in path.split(".")[1:]:
        module = getattr(module, name, None)
    if module is not None:
        print(path)
"""


@pytest.fixture
def cupy():
    return pytest.importorskip("cupy", reason="CuPy is not installed (CI installs it for "
                                              "these tests)")


def test_each_name_of_the_stand_ins_modules_is_cupys(cupy):
    made = simulated_cupy._modules()
    problems, seen = [], set()
    for path in MODULES:
        _check_module(path, made[path], _import_quietly(path), problems, seen)
    problems += _submodules_a_plain_import_lacks(made)
    _assert_none(problems, f"CuPy {cupy.__version__}")


def test_objects_the_stand_in_hands_out_have_only_cupys_members(cupy):
    problems = []
    for where, ours, module, name in HANDED_OUT:
        _check_members(where, ours, getattr(_import_quietly(module), name), problems)
    _assert_none(problems, f"CuPy {cupy.__version__}")


def test_nccl_offers_only_what_cupys_compiled_nccl_has(cupy):
    path = importlib.util.find_spec("cupy_backends.cuda.libs.nccl").origin
    with open(path, "rb") as binary:
        data = binary.read()
    assert _embedded(data, "NcclCommunicator.allReduce") is not None, (
        f"{path} no longer carries the signatures Cython embeds: this test cannot read "
        "CuPy's NCCL API there")
    real = _import_quietly("cupy.cuda.nccl")
    problems = []
    for name in _offered(nccl):
        ours, where = getattr(nccl, name), f"cupy.cuda.nccl.{name}"
        if name == "available":     # whether libnccl loads; CuPy's fallback module has it too
            if not hasattr(real, name):
                problems.append(f"{where}: CuPy's cupy.cuda.nccl has no {name}")
        elif not _mentions(data, name):
            problems.append(f"{where}: CuPy's compiled nccl module ({path}) has no {name}")
        elif inspect.isclass(ours):
            _compare(where, _name(ours), _our_signature(ours), name,
                     _embedded(data, name), problems)
            for member, (value, _) in sorted(_members(ours).items()):
                qualified = f"{name}.{member}"
                if not _mentions(data, qualified):
                    problems.append(f"{where}.{member}: CuPy's compiled nccl module ({path}) "
                                    f"has no {qualified}")
                elif inspect.isroutine(value):
                    _compare(f"{where}.{member}", f"{_name(ours)}.{member}",
                             _our_signature(value), qualified, _embedded(data, qualified),
                             problems, dunder=_is_dunder(member))
        elif callable(ours):
            _compare(where, _name(ours), _our_signature(ours), name, _embedded(data, name),
                     problems)
    _assert_none(problems, f"CuPy {cupy.__version__}'s compiled nccl module")


def test_nccl_constants_have_the_values_of_nccl_h():
    problems = [f"cupy.cuda.nccl.{name} is {getattr(nccl, name)} here, "
                f"{NCCL_H.get(name, 'not in its enums')} in nccl.h"
                for name in _offered(nccl)
                if name.startswith("NCCL_") and NCCL_H.get(name) != getattr(nccl, name)]
    _assert_none(problems, "NCCL's nccl.h")


# -- the stand-in's side ---------------------------------------------------------------

def _offered(module):
    """The names a module of the stand-in offers: for one of its files, its __all__
    and what it defines at top level (not what it imports); for one built from
    simulated_cupy.CUPY, every public name and __version__."""
    if getattr(module, "__file__", None) is None:
        return sorted(n for n in vars(module) if not n.startswith("_") or n == "__version__")
    defined = set(getattr(module, "__all__", ()))
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(n.id for target in node.targets for n in ast.walk(target)
                           if isinstance(n, ast.Name))
    return sorted(n for n in defined if not n.startswith("_"))


def _members(cls):
    """name -> (value, the class that defines it) of the public members the
    stand-in's class offers: what the stand-in's own classes among its bases define
    (not object's or ctypes'), and the attributes their methods set on self (value
    ON_SELF). A dunder set to None refuses its protocol, so it offers nothing."""
    found = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("devtools."):
            found.update(dict.fromkeys(_set_on_self(klass), (ON_SELF, klass)))
            found.update((name, (value, klass)) for name, value in vars(klass).items())
    return {name: found[name] for name, (value, _) in found.items()
            if not name.startswith("_")
            or _is_dunder(name) and name not in BOOKKEEPING and value is not None}


def _set_on_self(klass):
    """The attributes the methods of the stand-in's ``klass`` assign to self."""
    try:
        tree = ast.parse(inspect.getsource(klass))
    except OSError:         # made by type() (the pinned pointer's type): no methods of its own
        return set()
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


def _our_signature(obj):
    try:
        return inspect.signature(obj)
    except ValueError:      # a class that keeps a builtin's constructor (an exception's)
        return None


# -- CuPy's side -----------------------------------------------------------------------

def _import_quietly(name):
    """CuPy's module ``name`` (cupy.cuda.nccl warns here that libnccl does not load)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def _signature(obj, names):
    """What CuPy's ``obj`` takes: the signature Cython embeds as the first line of
    its docstring, if that names one of ``names``, else inspect's; None where
    neither tells."""
    first = (getattr(obj, "__doc__", None) or "").strip().partition("\n")[0]
    embedded = EMBEDDED.fullmatch(first)
    if embedded and embedded["name"] in names:
        return _parse(embedded["parameters"])
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return signature.replace(return_annotation=P.empty, parameters=[
        p.replace(annotation=P.empty) for p in signature.parameters.values()])


def _constructor(cls):
    signature = _signature(cls, (cls.__name__, "__init__"))
    parameters = list(signature.parameters.values()) if signature else []
    if parameters and parameters[0].name == "self":
        return signature.replace(parameters=parameters[1:])
    return signature


def _real_member(cls, name):
    """("method" or "value", signature or None) of CuPy's ``cls.name``; None where it
    has none (or sets it to None, as cupy.cuda.Device.__hash__: it refuses it)."""
    try:
        value = inspect.getattr_static(cls, name)
    except AttributeError:
        return ("value", None) if name in _instance_attributes(cls) else None
    if value is None:
        return None
    if inspect.isroutine(value):
        return "method", _signature(getattr(cls, name), (name,))
    return "value", None


def _instance_attributes(cls):
    """The attributes CuPy's plain-Python classes set in __init__, which mostly needs
    a GPU: those their docstrings document ("~Stream.ptr (intptr_t): Raw stream
    handle."), and those of the instances that can be made without one."""
    cuda = _import_quietly("cupy.cuda")
    made = [cuda.Stream.null, cuda.runtime.CUDARuntimeError(2)]
    documented = {name for klass in cls.__mro__
                  for name in re.findall(r"~\w+\.(\w+) \(", klass.__doc__ or "")}
    return documented.union(*(vars(instance) for instance in made
                              if isinstance(instance, cls)))


def _embedded(data, qualified):
    """The signature Cython embedded for ``qualified`` in a compiled module's bytes."""
    found = re.search(rb"(?<![\w.])" + re.escape(qualified.encode())
                      + rb"\(([^\x00\n]*)\)(?:\s*->[^\x00\n]*)?(?=[\x00\n])", data)
    return _parse(found[1].decode()) if found else None


def _mentions(data, name):
    return re.search(rb"(?<!\w)" + re.escape(name.encode()) + rb"(?!\w)", data) is not None


def _parse(text):
    """inspect.Signature of Cython's "intptr_t dst, size_t size=0, *, str path=None",
    the C types dropped; a default that is no literal stays as its text."""
    parameters, kind = [], P.POSITIONAL_OR_KEYWORD
    for part in _split(text.replace("\\*", "*")):
        if part == "/":
            parameters = [p.replace(kind=P.POSITIONAL_ONLY) for p in parameters]
            continue
        if part == "*":
            kind = P.KEYWORD_ONLY
            continue
        declaration, has_default, default = part.partition("=")
        name = re.findall(r"\w+", declaration.partition(":")[0])[-1]
        if declaration.lstrip().startswith("**"):
            parameters.append(P(name, P.VAR_KEYWORD))
        elif declaration.lstrip().startswith("*"):
            parameters.append(P(name, P.VAR_POSITIONAL))
            kind = P.KEYWORD_ONLY
        else:
            parameters.append(P(name, kind, default=_Text.literal(default.strip())
                                if has_default else P.empty))
    return inspect.Signature(parameters)


def _split(text):
    """``text`` split at the commas outside brackets and quotes."""
    parts, current, depth, quote = [], "", 0, None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += char
    return parts + [current.strip()] if current.strip() else parts


class _Text(str):
    """A default as Cython wrote it where it is no literal ("float"): shown as written,
    never compared."""

    def __repr__(self):
        return str(self)

    @classmethod
    def literal(cls, text):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return cls(text)


# -- comparing -------------------------------------------------------------------------

def _check_module(path, ours, theirs, problems, seen):
    for name in _offered(ours):
        value, where = getattr(ours, name), f"{path}.{name}"
        if isinstance(value, types.ModuleType):
            continue                          # _submodules_a_plain_import_lacks
        if name == "__version__":
            if value.partition("+")[0] != theirs.__version__:
                problems.append(f"{where}: the stand-in imitates {value}, CuPy here is "
                                f"{theirs.__version__}")
        elif not hasattr(theirs, name):
            problems.append(f"{where} ({_name(value)}): CuPy's {path} has no {name}")
        else:
            _check_object(where, value, getattr(theirs, name), problems, seen)


def _check_object(where, ours, theirs, problems, seen):
    if ours is theirs:
        return
    if inspect.isclass(ours):
        if not inspect.isclass(theirs):
            problems.append(f"{where} is a class here, {theirs!r} in CuPy")
            return
        bases = [b.__name__ for b in ours.__mro__
                 if b.__module__ == "builtins" and b not in theirs.__mro__]
        if bases:
            problems.append(f"{where} ({_name(ours)}) derives from {', '.join(bases)}; "
                            f"{_name(theirs)} does not")
        if ours not in seen:
            seen.add(ours)
            _compare(where, _name(ours), _our_signature(ours), _name(theirs),
                     _constructor(theirs), problems)
            _check_members(where, ours, theirs, problems)
    elif callable(ours):
        _compare(where, _name(ours), _our_signature(ours), _name(theirs, where),
                 _signature(theirs, (where.rpartition(".")[2],)), problems)
    elif ours != theirs:
        problems.append(f"{where} is {ours!r} here, {theirs!r} in CuPy")


def _check_members(where, ours, theirs, problems):
    for name, (value, owner) in sorted(_members(ours).items()):
        label = f"{where}.{name}"
        kind = "method" if inspect.isroutine(value) else "value"
        real = _real_member(theirs, name)
        if real is None:
            refused = " (it sets it to None, refusing it)" if getattr(
                theirs, name, ...) is None else ""
            what = ON_SELF if value is ON_SELF else f"a {kind}"
            problems.append(f"{label}: {_name(theirs)} has no {name}{refused}; the "
                            f"stand-in's {_name(owner)} has it, {what}")
        elif real[0] != kind:
            problems.append(f"{label} is a {kind} here ({_name(owner)}), a {real[0]} on "
                            f"{_name(theirs)}")
        elif kind == "method":
            _compare(label, f"{_name(owner)}.{name}", _our_signature(value),
                     f"{_name(theirs)}.{name}", real[1], problems, dunder=_is_dunder(name))


def _compare(where, our_name, ours, their_name, theirs, problems, dunder=False):
    """Add a problem where a call ``ours`` takes may fail on ``theirs``; nothing where
    either cannot be read. Operators pass a dunder's arguments by position only."""
    if ours is None or theirs is None:
        return
    called = ours.replace(parameters=[p.replace(kind=P.POSITIONAL_ONLY)
                                      if dunder and p.kind is P.POSITIONAL_OR_KEYWORD else p
                                      for p in ours.parameters.values()])
    reasons = _refusals(called, theirs)
    if reasons:
        problems.append(f"{where}: {'; '.join(reasons)}\n"
                        f"      stand-in {our_name}{ours}\n"
                        f"      CuPy     {their_name}{theirs}")


def _refusals(ours, theirs):
    """How calls that ``ours`` takes can fail on ``theirs``, in words: [] where none can."""
    mine, real = list(ours.parameters.values()), list(theirs.parameters.values())
    positional = [p for p in mine if p.kind in POSITIONAL]
    their_positional = [p for p in real if p.kind in POSITIONAL]
    their_keywords = {p.name: p for p in real if p.kind in BY_KEYWORD}
    their_kinds = {p.kind for p in real}
    reasons = []
    for index, p in enumerate(positional):
        if index >= len(their_positional):
            if P.VAR_POSITIONAL not in their_kinds:
                reasons.append(f"takes {p.name!r} as positional argument {index + 1}, CuPy "
                               f"takes {len(their_positional)}")
        elif p.kind is P.POSITIONAL_OR_KEYWORD and their_positional[index].name != p.name:
            reasons.append(f"positional argument {index + 1} is {p.name!r} here, "
                           f"{their_positional[index].name!r} in CuPy")
    for p in mine:
        if p.kind in BY_KEYWORD and p.name not in their_keywords \
                and P.VAR_KEYWORD not in their_kinds:
            reasons.append(f"takes {p.name}= by keyword, CuPy does not")
        elif p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and p.kind not in their_kinds:
            reasons.append(f"takes {p}, CuPy does not")
        elif p.default is not P.empty and p.name in their_keywords:
            default = their_keywords[p.name].default
            if not isinstance(default, _Text) and default is not P.empty \
                    and default != p.default:
                reasons.append(f"{p.name} defaults to {p.default!r} here, to {default!r} "
                               "in CuPy")
    for index, p in enumerate(real):          # positional parameters come first
        if p.default is P.empty and p.kind in POSITIONAL + (P.KEYWORD_ONLY,):
            mine_too = (positional[index] if p.kind in POSITIONAL and index < len(positional)
                        else ours.parameters.get(p.name))
            if mine_too is None or mine_too.default is not P.empty:
                reasons.append(f"a call may leave out {p.name!r}, which CuPy requires")
    return reasons


def _submodules_a_plain_import_lacks(made):
    """The stand-in's submodules that `import cupy` does not reach in CuPy: code that
    uses one without importing it would work on the stand-in only."""
    paths = [f"{path}.{name}" for path, module in made.items() for name in _offered(module)
             if isinstance(getattr(module, name), types.ModuleType)]
    run = subprocess.run([sys.executable, "-c", REACHABLE, *paths], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, f"`import cupy` failed in a process of its own:\n{run.stderr}"
    reached = run.stdout.split()
    return [f"{path}: the stand-in has it after `import cupy`; CuPy only after "
            f"`import {path}` (or `from {path.rpartition('.')[0]} import "
            f"{path.rpartition('.')[2]}`)" for path in paths if path not in reached]


def _is_dunder(name):
    return name.startswith("__") and name.endswith("__")


def _name(obj, where=None):
    """obj's full name; ``where`` for one without a module (a CuPy ufunc)."""
    if isinstance(obj, str):
        return obj
    if getattr(obj, "__module__", None) is None:
        return where or repr(obj)
    return f"{obj.__module__}.{obj.__qualname__}"


def _assert_none(problems, against):
    assert not problems, (f"devtools/simulated_cupy differs from {against} in "
                          f"{len(problems)} ways:\n- " + "\n- ".join(problems))
