"""The images built and run by docker/build-and-run-locally.sh, with the
container engine this machine has: docker with a running daemon, or podman as
root (docker/install-engine.sh installs it on Debian; .ci/run does). The tests
install nothing and skip, saying why, where the script finds no engine.

The CPU image trains the digits on 2 ranks as its ordinary user, and the
script runs any command in it: the Keras example. The GPU image
(Dockerfile.gpu) is built and its `mpitrainrun --check-build` run only with
MPITRAIN_DOCKER_GPU_IMAGE=1: its build and size are in docs/docker.md.
MPITRAIN_SKIP_DOCKER_IMAGE=1 leaves all of them out.
"""

import os
import re
import subprocess

import pytest

from tests.mpi_harness import ROOT

SCRIPT = os.path.join(ROOT, "docker", "build-and-run-locally.sh")
# From nothing, a build takes minutes (docs/docker.md); each run rebuilds what changed.
BUILD_AND_RUN_SECONDS = 2400


@pytest.fixture(scope="module")
def engine():
    if os.environ.get("MPITRAIN_SKIP_DOCKER_IMAGE") == "1":
        pytest.skip("MPITRAIN_SKIP_DOCKER_IMAGE=1")
    found = subprocess.run([SCRIPT, "--engine"], capture_output=True, text=True, timeout=120)
    if found.returncode != 0:
        pytest.skip(found.stdout.strip() + found.stderr.strip())
    return found.stdout.strip()


def build_and_run(*arguments):
    """The script's output; it must succeed."""
    result = subprocess.run([SCRIPT, *arguments], capture_output=True, text=True,
                            timeout=BUILD_AND_RUN_SECONDS)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    return log


def accuracy_of_rank_0(log):
    # Rank 0's line, tagged by Open MPI: the command ran 2 ranks.
    accuracy = re.search(r"\[1,0\]<stdout>: test accuracy: ([0-9.]+)", log)
    assert accuracy, log[-6000:]
    return float(accuracy.group(1))


def test_the_image_trains_the_digits_on_two_ranks_as_its_user(engine):
    assert accuracy_of_rank_0(build_and_run()) >= 0.9
    assert "uid=1000(trainer) gid=1000(trainer)" in build_and_run("id")


def test_the_script_runs_any_command_in_the_image_such_as_the_keras_example(engine):
    log = build_and_run("mpitrainrun", "-np", "2", "python", "examples/keras_digits.py")
    assert accuracy_of_rank_0(log) >= 0.9
    # Keras's own metrics on the example's progress bar: the default command,
    # PyTorch's, shows only its loss there.
    assert "accuracy=" in log, log[-6000:]


@pytest.mark.skipif(os.environ.get("MPITRAIN_DOCKER_GPU_IMAGE") != "1",
                    reason="the GPU image is built only with MPITRAIN_DOCKER_GPU_IMAGE=1 "
                           "(10-15 minutes and 5.6 GB more; docs/docker.md)")
def test_the_gpu_image_holds_cuda_torch_cupy_and_open_mpi(engine):
    report = build_and_run("--gpu")[-6000:]
    assert re.search(r"\[x\] PyTorch 2\.13\.0(\+cu\d+)? \(mpitrain\.torch\)", report), report
    assert re.search(r"\[x\] library: Open MPI v5", report), report
    # No GPU here: CuPy imports and finds no driver; torch's CUDA build says 0 GPUs.
    assert "no CUDA device here (CuPy finds no" in report, report
    assert "GPUs visible: 0 to PyTorch" in report, report
    # What nccl_built() asks on a GPU machine: CuPy loads the NCCL that came with torch.
    nccl = build_and_run("--gpu", "python", "-c",
                         "from cupy.cuda import nccl; print('NCCL', nccl.get_version())")
    assert re.search(r"NCCL 2\d{4}\b", nccl), nccl[-6000:]
