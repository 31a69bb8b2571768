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
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    echo "install-engine: installing podman, runc and debootstrap needs root and apt-get" \
         "(Debian, Ubuntu); elsewhere install Docker or podman yourself" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-upgrade keeps any of the three already installed as it is. apt also
# upgrades every installed package built from the same source as one it
# installs (libsubid4, which podman needs, upgraded login and passwd);
# Upgrade-By-Source-Package=false turns that off.
apt_flags=(-y -qq --no-install-recommends --no-upgrade
           -o APT::Get::Upgrade-By-Source-Package=false)
packages=(podman runc debootstrap)
# apt-get -s: what it would do, one "Inst PACKAGE (VERSION ...)" line a package.
new=$(apt-get -s "${apt_flags[@]}" install "${packages[@]}" \
      | awk '$1 == "Inst" {names = names " " $2} END {print names}')
echo "install-engine: installing$new"
apt-get "${apt_flags[@]}" install "${packages[@]}" > /dev/null
echo "install-engine: installed $(podman --version)"
