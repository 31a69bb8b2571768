"""The docs say what the code does: the Horovod migration tables name every
public name of Horovod's modules and tell truly whether mpitrain has it, and
the configuration page lists every variable and launcher flag."""

import ast
import contextlib
import functools
import glob
import importlib
import inspect
import io
import os
import re
import shlex
import sys

import pytest

from devtools.simulated_cupy import settings as simulated_gpu
from mpitrain.launcher import run
from mpitrain.runtime import config
from tests.mpi_harness import ROOT
from tests.test_horovod_api import DIFFERENCES, HELPER, HOROVOD as HOROVOD_API
from tests.test_readme import installed_extras

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


def test_no_page_calls_a_module_that_exists_not_provided():
    said = []
    for page in COMMAND_PAGES:
        text = open(os.path.join(ROOT, page)).read()
        # From "not provided" to the end of its clause or table cell.
        for claim in re.finditer(r"not provided(?:[^.|;]|\.(?=\S))*", text, re.I):
            said += [(page, name) for name in re.findall(r"`(mpitrain(?:\.\w+)+)`",
                                                         claim.group())]
    existing = [f"{page}: {name}" for page, name in said if module_exists(name)]
    assert not existing, "pages call these modules not provided: " + ", ".join(existing)


def module_exists(name):
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


# The shell commands of the README and the docs, as a user copies them into a
# shell that has not activated the environment, from the repository root.
COMMAND_PAGES = ["README.md"] + sorted(
    os.path.relpath(path, ROOT) for pattern in ("docs/*.md", "docs/benchmarks/*.md")
    for path in glob.glob(os.path.join(ROOT, pattern)))
RUNS_FROM_THE_ENVIRONMENT = ("mpitrainrun", "mpirun", "mpiexec", "python", "pip", "pytest")
# Pages whose commands still say plain `mpitrainrun` (issue 18): the benchmark
# pages are written by benchmarks/allreduce.py and benchmarks/plot_train_step.py.
REPOSITORY_FILE = re.compile(r"^(?:examples|benchmarks|docs|docker|tests)/[\w./-]*\w$")


def shell_commands():
    """(page:line, command) for every line of a ```sh block or of an
    indented block that runs something, and every `...` span that runs a .py file."""
    starts = re.compile(r"^(?:\w+=\S+ )*(?:\.venv/bin/|sudo |docker |for |python3? |"
                        + "|".join(RUNS_FROM_THE_ENVIRONMENT) + r")")
    found = []
    for page in COMMAND_PAGES:
        fence, prose = None, []
        for number, line in enumerate(open(os.path.join(ROOT, page)).read().splitlines(), 1):
            where = f"{page}:{number}"
            if line.lstrip().startswith("```"):
                fence = None if fence is not None else line.strip()[3:]
                line = ""
            elif fence in ("sh", "bash"):
                command = re.sub(r"(^|\s)#.*", "", line).strip()
                if found and found[-1][1].endswith("\\") and found[-1][0].startswith(page):
                    found[-1] = (found[-1][0], found[-1][1][:-1] + " " + command)
                elif command:
                    found.append((where, command))
            elif fence is None and line.startswith("    ") and starts.match(line.strip()):
                found.append((where, line.strip()))
            prose.append("" if fence is not None else line)
        text = "\n".join(prose)
        for span in re.finditer(r"`([^`]+)`", text):
            command = " ".join(span.group(1).split())
            if starts.match(command) and ".py" in command:
                line = text.count("\n", 0, span.start()) + 1
                found.append((f"{page}:{line}", command))
    return found


def simple_commands(command):
    """The words of each command of a line, without leading VAR=value, sudo,
    and the keywords of a for loop."""
    for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", command):
        words = shlex.split(part)
        while words and (re.match(r"^\w+=", words[0]) or words[0] in ("do", "sudo", "until")):
            words = words[1:]
        if words and words[0] not in ("for", "done"):
            yield words


@functools.lru_cache(maxsize=None)
def script_options(path):
    """The --options a script's argparse parser takes."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return {"-h", "--help"} | {
        arg.value for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
        for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")}


def command_problems(where, command):
    """What is wrong with one documented command, as sentences."""
    known = set(config.variable_names()) | {simulated_gpu.VARIABLE}   # the tests' own
    problems = [f"{name} is not a variable of mpitrain" for name in re.findall(
        r"(?:^|\s)(MPITRAIN_\w+)=", command) if name not in known]
    for words in simple_commands(command):
        program = words[0]
        if program in RUNS_FROM_THE_ENVIRONMENT:
            problems.append(f"`{program}` is not on PATH until the environment is "
                            f"activated: write .venv/bin/{program}")
        if program.startswith(".venv/bin/") and not os.path.exists(
                os.path.join(os.path.dirname(sys.executable), program[len(".venv/bin/"):])):
            problems.append(f"{program} is not installed by the set-up commands")
        if os.path.basename(program) == "mpitrainrun":
            launcher_words = [("2" if re.fullmatch(r"\$\w+|N", word) else word)
                              for word in words[1:]]
            try:
                with contextlib.redirect_stderr(io.StringIO()) as error:
                    run.build_parser().parse_args(launcher_words)
            except SystemExit:
                problems.append(f"mpitrainrun refuses it: {error.getvalue().splitlines()[-1]}")
        script = None
        for word in words:
            if REPOSITORY_FILE.match(word) and "<" not in word:
                if not os.path.exists(os.path.join(ROOT, word)):
                    problems.append(f"{word} does not exist")
                elif word.endswith(".py") and script is None:
                    script = word
            elif script and word.startswith("--") \
                    and word.split("=")[0] not in script_options(script):
                problems.append(f"{script} has no option {word.split('=')[0]}")
            elif re.fullmatch(r"\.\[[\w,-]+\]", word):
                problems += [f"no extra {name!r} in setup.py" for name in word[2:-1].split(",")
                             if name not in installed_extras()]
    return [f"{where}: `{command}`: {problem}" for problem in problems]


def test_the_pages_have_shell_commands_to_check():
    pages = {where.split(":")[0] for where, _ in shell_commands()}
    assert {"README.md", "docs/timeline.md", "docs/configuration.md",
            "docs/adasum.md", "docs/benchmarks/README.md"} <= pages


def test_every_documented_command_names_files_flags_and_programs_that_exist():
    problems = [problem for command in shell_commands() for problem in command_problems(*command)]
    assert not problems, "\n".join(problems)
