"""Horovod's own test suites run against mpitrain, with only the import changed.

    .venv/bin/python benchmarks/horovod_conformance.py HOROVOD_CHECKOUT \
        [--np 2] [--suite torch tensorflow keras] [-k EXPRESSION] [--timeout 900] \
        [--test-timeout 240] [--work DIR]

HOROVOD_CHECKOUT is a checkout of github.com/horovod/horovod (its test/parallel and
test/utils are used). Horovod's code is not ours, so nothing of it enters this
repository: at run time the modules are copied into a scratch directory where
``import horovod.X as hvd`` becomes ``import mpitrain.Y as hvd`` and nothing else
changes, and a generated shim on PYTHONPATH serves the few Horovod helpers the tests
import that are not code under test (``horovod.tensorflow.util._executing_eagerly``,
``horovod.common.util.is_version_greater_equal_than``,
``horovod.runner.util.threads.in_thread``, and ``mock`` as unittest.mock). The Keras
suite also needs the ``parameterized`` package.

torch and Keras run one mpirun job per module; a job that outlives --timeout is
killed, the test its ranks were in (from each rank's progress file) counts as a hang,
and the module runs again without it. TensorFlow runs one job per test, with
--test-timeout each: its tests run in graph and eager mode, and a graph-mode hang
would leave every later test of a shared job desynchronized.

The table comes from the JUnit XML every rank writes: a test passed when it passed
on every rank, failed when it failed on any, was skipped when skipped everywhere;
then each failing test with the first line of its message.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from devtools.mpi_jobs import job_environment, kill_session, mpirun_command  # noqa: E402

SUITES = {"torch": "test_torch.py", "tensorflow": "test_tensorflow.py",
          "keras": "test_tensorflow2_keras.py"}
ONE_JOB_PER_TEST = {"tensorflow"}
SUPPORT = ["test/parallel/base_test_tensorflow.py", "test/conftest.py",
           "test/utils/common.py"]
# Horovod's module -> the module a user imports instead.
IMPORTS = {"horovod.torch": "mpitrain.torch", "horovod.tensorflow": "mpitrain.tensorflow",
           "horovod.tensorflow.keras": "mpitrain.tensorflow.keras",
           "horovod.keras": "mpitrain.tensorflow.keras"}
_IMPORT_LINE = re.compile(r"^(\s*)import (horovod(?:\.\w+)*) as (\w+)\s*$", re.M)

SHIM = {
    "horovod/__init__.py": '"""Horovod helpers its tests import that are not code under test."""\n',
    "horovod/tensorflow/__init__.py": "",
    "horovod/tensorflow/util.py":
        "import tensorflow as tf\n\n\n"
        "def _executing_eagerly():\n    return tf.executing_eagerly()\n",
    "horovod/common/__init__.py": "",
    "horovod/common/util.py":
        "from packaging import version\n\n\n"
        "def is_version_greater_equal_than(ver, target):\n"
        "    return version.parse(ver) >= version.parse(target)\n",
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py":
        "import threading\n\n\n"
        "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
        "    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
        "    thread.start()\n    return thread\n",
    # parameterized reads the backport's version_info; the standard library's is new enough.
    "mock.py": "from unittest.mock import *  # noqa: F401,F403\n\nversion_info = (5, 0, 0)\n",
    "conformance_progress.py":
        '"""Writes each test\'s start and end to this rank\'s progress file."""\n\n\n'
        "class Progress:\n"
        "    def __init__(self, path):\n"
        "        self.file = open(path, 'a', buffering=1)\n\n"
        "    def pytest_runtest_logstart(self, nodeid, location):\n"
        "        self.file.write(f'start {nodeid}\\n')\n\n"
        "    def pytest_runtest_logfinish(self, nodeid, location):\n"
        "        self.file.write(f'end {nodeid}\\n')\n",
}


def job_rank():
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def prepare(checkout, work):
    """Copy the suites into ``work`` with only the imports changed; write the shim."""
    for suite, module in SUITES.items():
        source = open(os.path.join(checkout, "test", "parallel", module)).read()
        changed, count = _IMPORT_LINE.subn(_import_of_mpitrain, source)
        if not count:
            raise SystemExit(f"{module}: no 'import horovod... as' line to change")
        _write(os.path.join(work, "test", "parallel", module), changed)
    for path in SUPPORT:
        _write(os.path.join(work, path), open(os.path.join(checkout, path)).read())
    for path, text in SHIM.items():
        _write(os.path.join(work, "shim", path), text)


def _import_of_mpitrain(match):
    indent, module, alias = match.groups()
    if module not in IMPORTS:
        raise SystemExit(f"no mpitrain module stands for {module}")
    return f"{indent}import {IMPORTS[module]} as {alias}"


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as file:
        file.write(text)


def environment(work):
    """The jobs' environment: the shim and Horovod's test directories, then the
    caller's PYTHONPATH (an mpitrain found there is the one tested), then this
    checkout."""
    paths = [os.path.join(work, "shim"), os.path.join(work, "test", "parallel"),
             os.path.join(work, "test", "utils"), os.environ.get("PYTHONPATH", ""), ROOT]
    env = job_environment({"TF_CPP_MIN_LOG_LEVEL": "2"})
    # Ranks whose own assertions disagree leave a test at different points; the
    # stall shutdown ends such a test on every rank, naming what each rank waits
    # on, well before the job's timeout would call it a hang.
    env.setdefault("MPITRAIN_STALL_CHECK_TIME_SECONDS", "20")
    env.setdefault("MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS", "60")
    env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    return env


def pytest_options(work):
    """Test ids are relative to the copied test/ directory, where every job runs."""
    return ["-p", "no:cacheprovider", "--rootdir", os.path.join(work, "test"),
            "-c", os.devnull, "-q", "--color=no"]


def collect(work, module, keyword):
    """The module's test ids, in order, collected in one plain process."""
    command = [sys.executable, "-m", "pytest", "--collect-only", f"parallel/{module}",
               *pytest_options(work), *(["-k", keyword] if keyword else [])]
    listing = subprocess.run(command, cwd=os.path.join(work, "test"),
                             env=environment(work), capture_output=True, text=True)
    if listing.returncode not in (0, 5):
        raise SystemExit(f"collecting {module} failed:\n{listing.stdout}{listing.stderr}")
    return [line for line in listing.stdout.splitlines() if "::" in line]


def run_job(args, work, job, selection, timeout):
    """One mpirun of pytest on ``selection``: None if it ended, else the test that hung."""
    prefix = os.path.join(work, "results", job)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    command = (mpirun_command(args.np) +
               [sys.executable, os.path.abspath(__file__), "--rank-job", prefix,
                *selection])
    with open(prefix + ".log", "w") as log:
        process = subprocess.Popen(command, cwd=os.path.join(work, "test"),
                                   env=environment(work), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=timeout)
            return None
        except subprocess.TimeoutExpired:
            kill_session(process.pid)
            process.wait()
    return _first_unfinished(prefix, args.np) or "(before any test started)"


def _first_unfinished(prefix, nprocs):
    """The test some rank started and did not end, per the ranks' progress files."""
    for rank in range(nprocs):
        try:
            lines = open(f"{prefix}.rank{rank}.progress").read().split("\n")
        except FileNotFoundError:
            continue
        ended = {line[4:] for line in lines if line.startswith("end ")}
        for line in lines:
            if line.startswith("start ") and line[6:] not in ended:
                return line[6:]
    return None


def run_suite(args, work, suite):
    """Run one suite's jobs; returns the ids of the tests that hung."""
    module = f"parallel/{SUITES[suite]}"
    hangs = []
    if suite in ONE_JOB_PER_TEST:
        for number, test in enumerate(collect(work, SUITES[suite], args.k)):
            print(f"  {suite} {number}: {test}", flush=True)
            if run_job(args, work, f"{suite}.{number:04d}", [test], args.test_timeout):
                hangs.append(test)
        return hangs
    for attempt in range(args.attempts):
        selection = [module, *(["-k", args.k] if args.k else []),
                     *[argument for test in hangs for argument in ("--deselect", test)]]
        hung = run_job(args, work, f"{suite}.{attempt:04d}", selection, args.timeout)
        if hung is None:
            break
        print(f"  {suite}: {hung} hung; running the module again without it", flush=True)
        hangs.append(hung)
    return hangs


def rank_job(prefix, selection):
    """On each rank: pytest on the selection, writing JUnit XML and progress."""
    import pytest
    from conformance_progress import Progress
    rank = job_rank()
    options = pytest_options(os.path.dirname(os.getcwd()))
    return pytest.main([*selection, *options, f"--junitxml={prefix}.rank{rank}.xml"],
                       plugins=[Progress(f"{prefix}.rank{rank}.progress")])


def outcomes(work, suite, nprocs):
    """{test: {rank: (outcome, message)}} from every rank's JUnit XML of the suite's
    jobs; a test a rank started without a report of it is "failed", "no result"."""
    results = {}
    directory = os.path.join(work, "results")
    for job in sorted({name.split(".rank")[0] for name in os.listdir(directory)
                       if re.fullmatch(rf"{suite}\.[0-9]+\.rank[0-9]+\.progress", name)}):
        for rank in range(nprocs):
            prefix = os.path.join(directory, f"{job}.rank{rank}")
            if not os.path.exists(prefix + ".progress"):
                continue
            for line in open(prefix + ".progress").read().splitlines():
                if line.startswith("start "):
                    test = line[6:].split("::", 1)[1]
                    results.setdefault(test, {})[rank] = ("failed", "no result: see "
                                                          + job + ".log")
            if os.path.exists(prefix + ".xml"):
                for case in ElementTree.parse(prefix + ".xml").iter("testcase"):
                    test = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
                    results.setdefault(test, {})[rank] = _outcome(case)
    return results


def _outcome(case):
    for kind in ("failure", "error", "skipped"):
        element = case.find(kind)
        if element is not None:
            message = (element.get("message") or element.text or "").strip()
            return ("skipped" if kind == "skipped" else "failed"), message
    return "passed", ""


def summarize(results, hangs, nprocs):
    """The counts of one suite's row, and its failures as (test, rank, message)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "hang": len(hangs)}
    failures = []
    hung = {test.split("::", 1)[1] for test in hangs}
    for test, by_rank in sorted(results.items()):
        if test in hung:
            continue
        for rank in range(nprocs):
            by_rank.setdefault(rank, ("failed", "no result"))
        kinds = {outcome for outcome, _ in by_rank.values()}
        if "failed" in kinds:
            counts["failed"] += 1
            rank = min(rank for rank, (outcome, _) in by_rank.items() if outcome == "failed")
            failures.append((test, rank, by_rank[rank][1].split("\n")[0][:200]))
        else:
            counts["skipped" if kinds == {"skipped"} else "passed"] += 1
    return counts, failures + [(test, None, "hang") for test in sorted(hung)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", help="a checkout of github.com/horovod/horovod")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--suite", nargs="+", choices=list(SUITES), default=list(SUITES))
    parser.add_argument("-k", help="pytest's -k expression, to run some tests only")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds for a job running a whole module")
    parser.add_argument("--test-timeout", type=float, default=240,
                        help="seconds for a job running one test")
    parser.add_argument("--attempts", type=int, default=4,
                        help="module jobs at most, each without the tests that hung before")
    parser.add_argument("--work", help="scratch directory (default: a new temporary one)")
    args = parser.parse_args()
    if "keras" in args.suite and importlib.util.find_spec("parameterized") is None:
        raise SystemExit("the Keras suite needs the parameterized package "
                         "(.venv/bin/pip install parameterized)")
    work = args.work or tempfile.mkdtemp(prefix="horovod-conformance-")
    prepare(os.path.abspath(args.checkout), work)
    print(f"scratch directory: {work}", flush=True)
    table, failures = [], []
    for suite in args.suite:
        hangs = run_suite(args, work, suite)
        counts, failed = summarize(outcomes(work, suite, args.np), hangs, args.np)
        table.append(f"| {SUITES[suite]} | {sum(counts.values())} | "
                     + " | ".join(str(count) for count in counts.values()) + " |")
        failures += [(SUITES[suite], *entry) for entry in failed]
    print(f"\n{args.np} ranks, results in {work}/results\n\n"
          "| module | tests | passed | failed | skipped | hang |\n|---|---|---|---|---|---|")
    print("\n".join(table))
    if failures:
        print("\n| module | test | first failing rank | message |\n|---|---|---|---|")
        for module, test, rank, message in failures:
            print(f"| {module} | {test} | {'' if rank is None else rank} | "
                  f"{message.replace('|', '/')} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-job":
        sys.exit(rank_job(sys.argv[2], sys.argv[3:]))
    main()
