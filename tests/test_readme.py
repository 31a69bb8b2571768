"""The README's two commands: the first trains the digits example on 2 ranks
through mpitrainrun, the second is exactly what CI runs, and the extras they
install exist."""

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys

from mpitrain.launcher import run
from tests.mpi_harness import ROOT, job_environment


def readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```sh\n(.+?)\n```", text, re.S)


def installed_extras():
    """The extras of the installed mpitrain (the test command installs it with -e)."""
    return set(importlib.metadata.metadata("mpitrain").get_all("Provides-Extra"))


def test_the_first_command_trains_the_digits_on_two_ranks():
    train = readme_commands()[0]
    assert train.endswith("mpitrainrun -np 2 .venv/bin/python examples/pytorch_digits.py")


def test_ci_runs_the_readme_test_command():
    tests = readme_commands()[1]
    assert tests in open(os.path.join(ROOT, ".ci", "run")).read()


def test_the_extras_the_commands_install_exist():
    for command in readme_commands():
        for extras in re.findall(r"-e '\.\[([\w,-]+)\]'", command):
            assert set(extras.split(",")) <= installed_extras(), extras


def test_the_launcher_runs_the_numpy_example_on_two_ranks():
    launcher = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
    result = subprocess.run(
        [launcher, "-np", "2", sys.executable, "examples/numpy_softmax_regression.py"],
        cwd=ROOT, env=job_environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "weights identical on all 2 ranks: True" in result.stdout
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.6


def test_the_two_machine_command_gives_the_remote_ranks_this_environments_python(capsys):
    (line,) = [line for line in "\n".join(readme_commands()).splitlines()
               if "# two machines" in line]
    launcher, *args = shlex.split(line, comments=True)
    assert launcher == ".venv/bin/mpitrainrun" and args[-2:] == ["python", "train.py"]
    assert run.main(["--dry-run"] + args, job_environment()) == 0
    mpirun_line = capsys.readouterr().out
    assert "--host node1:4,node2:4" in mpirun_line
    # Remote ranks start with their own login PATH unless mpirun passes this one on.
    assert "-x PATH " in mpirun_line


def test_the_readme_gives_the_suites_size_as_it_is():
    # The time and memory the README states were measured on this many tests;
    # once the suite has grown or shrunk by a quarter they are stale.
    stated = int(re.search(r"(\d+) tests took about", open(os.path.join(ROOT, "README.md"))
                           .read()).group(1))
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=job_environment({"TF_CPP_MIN_LOG_LEVEL": "2"}), capture_output=True,
        text=True, timeout=600)
    count = int(re.search(r"^(\d+) tests collected", collected.stdout, re.M).group(1))
    assert abs(count - stated) <= count / 4, (
        f"the README gives the suite's time and memory for {stated} tests, but pytest "
        f"collects {count}: measure the suite again and update the README")
