#!/usr/bin/env bash
# Set-up, run once by hand or by .ci/run: installs what
# docker/build-and-run-locally.sh needs on a Debian machine that runs no
# Docker engine, as root: podman (the engine), runc (its runtime here) and
# debootstrap (to make the base image where no registry can be reached).
# About 20 s and 60 MB. Nothing that pytest runs installs system packages; the
# image's test skips where no engine is found.
set -euo pipefail

if docker info > /dev/null 2>&1; then
    echo "install-engine: docker's daemon answers; nothing to install"
    exit 0
fi
if command -v podman > /dev/null && command -v runc > /dev/null \
        && command -v debootstrap > /dev/null; then
    echo "install-engine: podman, runc and debootstrap are installed"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "install-engine: installing podman, runc and debootstrap needs root and apt-get" \
         "(Debian, Ubuntu); elsewhere install Docker or podman yourself" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# Without recommends: no CNI network plugins, hence --network=host in the script.
apt-get install -y -qq --no-install-recommends podman runc debootstrap > /dev/null
echo "install-engine: installed $(podman --version)"
