"""The README's commands are the ones CI runs, and the launcher behaves."""

import os
import re
import subprocess
import sys

from tests.mpi_harness import ROOT, job_environment


def readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```sh\n(.+?)\n```", text, re.S)


def test_ci_runs_the_readme_test_command():
    train, tests = readme_commands()[:2]
    assert "mpitrainrun -np 2" in train
    assert tests in open(os.path.join(ROOT, ".ci", "run")).read()


def test_the_launcher_runs_the_example_on_two_ranks():
    launcher = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
    result = subprocess.run(
        [launcher, "-np", "2", sys.executable, "examples/numpy_softmax_regression.py"],
        cwd=ROOT, env=job_environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "weights identical on all 2 ranks: True" in result.stdout
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.6


def test_the_launcher_passes_on_the_exit_code_and_explains_usage():
    launcher = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
    failed = subprocess.run([launcher, "-np", "2", sys.executable, "-c",
                             "import sys; sys.exit(3)"], cwd=ROOT, env=job_environment(),
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0
    usage = subprocess.run([launcher, "-np", "2"], capture_output=True, text=True)
    assert usage.returncode == 2 and "give the program to run" in usage.stderr
