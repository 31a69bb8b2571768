"""The Docker image built and run, without a Docker engine or a registry:
docker/build-and-run-locally.sh makes the Dockerfile's base image with
debootstrap, builds the Dockerfile with podman and runs the image's default
command, which trains the digits on 2 ranks as the image's ordinary user.

About 8 minutes from nothing on a 2-core machine, under a minute once its
cache (/var/cache/mpitrain-docker) holds the layers. Needs root and Debian's
apt; set MPITRAIN_SKIP_DOCKER_IMAGE=1 to leave it out.
"""

import os
import re
import shutil
import subprocess

import pytest

from tests.mpi_harness import ROOT

SCRIPT = os.path.join(ROOT, "docker", "build-and-run-locally.sh")


def reason_it_cannot_run():
    if os.environ.get("MPITRAIN_SKIP_DOCKER_IMAGE") == "1":
        return "MPITRAIN_SKIP_DOCKER_IMAGE=1"
    if os.geteuid() != 0:
        return "debootstrap and podman build need root"
    tools = ("podman", "runc", "debootstrap")
    if not shutil.which("apt-get") and not all(shutil.which(tool) for tool in tools):
        return "no apt-get to install podman, runc and debootstrap from (not Debian)"
    return None


@pytest.mark.skipif(reason_it_cannot_run() is not None, reason=str(reason_it_cannot_run()))
def test_the_image_builds_and_trains_on_two_ranks_as_its_user():
    result = subprocess.run([SCRIPT], capture_output=True, text=True, timeout=1800)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert "COMMIT localhost/mpitrain:local" in log, log[-6000:]
    # The image's USER, seen by `id` in a container of the image.
    assert "uid=1000(trainer) gid=1000(trainer)" in log, log[-6000:]
    # Rank 0's line, tagged by Open MPI: the default command ran 2 ranks.
    accuracy = re.search(r"\[1,0\]<stdout>: test accuracy: ([0-9.]+)", log)
    assert accuracy, log[-6000:]
    assert float(accuracy.group(1)) >= 0.9
