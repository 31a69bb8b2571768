#!/usr/bin/env bash
# Set-up, run once by hand or by .ci/run: installs what
# docker/build-and-run-locally.sh needs on a Debian machine that runs no
# Docker engine, as root: podman (the engine), runc (its runtime here) and
# debootstrap (to make the base image where no registry can be reached),
# with the packages they depend on (on Debian 12: 11 more, such as conmon,
# iptables and libsubid4), and nothing else: no recommended packages, and no
# upgrade of a package already installed. It says which packages it installs
# before it does. About 20 s and 60 MB. Nothing that pytest runs installs
# system packages; the image's test skips where no engine is found.
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
# shellcheck source=../devtools/apt-install.sh
. "$(dirname "$0")/../devtools/apt-install.sh"
apt_install install-engine "elsewhere install Docker or podman yourself" \
    podman runc debootstrap
echo "install-engine: installed $(podman --version)"
