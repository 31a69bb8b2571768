#!/usr/bin/env bash
# Builds the Dockerfile and runs the image's default command (training on 2
# ranks, as the image's ordinary user) on a Debian machine with no Docker
# engine and no registry, as root:
#   1. podman and debootstrap from Debian's packages;
#   2. the FROM image made here: Debian bookworm by debootstrap with the
#      Python 3.11 that python:3.11-slim-bookworm has, imported under that name;
#   3. podman build of the Dockerfile as it is; podman run of its CMD.
# Idempotent: the base, podman's storage and the build's layers stay under
# $MPITRAIN_DOCKER_CACHE (default /var/cache/mpitrain-docker), so a second run
# only rebuilds what changed; delete that directory to start from nothing.
# pip inside the build sees this machine's pip configuration (indexes,
# find-links, certificate: bind-mounted read-only, never copied into the image).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${MPITRAIN_DOCKER_CACHE:-/var/cache/mpitrain-docker}
image=${MPITRAIN_DOCKER_IMAGE:-localhost/mpitrain:local}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
python=${PYTHON:-python3}
base=$(awk 'toupper($1) == "FROM" {print $2; exit}' "$repo/Dockerfile")
suite=${base##*-}                      # python:3.11-slim-bookworm -> bookworm
# python:3.11-slim-bookworm's own Python comes from python.org's sources; in
# Debian bookworm it is python3 (3.11), `python` is python-is-python3, and
# `python -m venv` needs python3-venv.
base_packages=python3,python3-venv,python-is-python3,ca-certificates,netbase

stage() {
    echo "== $1 (after $SECONDS s)"
}
# Each line prefixed by the seconds since the script began.
elapsed() {
    while IFS= read -r line; do printf '[%4d s] %s\n' "$SECONDS" "$line"; done
}

stage "tools"
if ! command -v podman > /dev/null || ! command -v runc > /dev/null \
        || ! command -v debootstrap > /dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -q > /dev/null
    # Without recommends: no CNI network plugins, hence --network=host below.
    timeout 600 apt-get install -y -q --no-install-recommends podman runc debootstrap > /dev/null
fi
mkdir -p "$cache"
exec 9> "$cache/lock"                  # one run at a time per cache
flock -w 1800 9

# overlay where this kernel and filesystem mount it (fast), vfs otherwise
# (a full copy of the file system per layer: slow, but works everywhere).
storage_driver=${MPITRAIN_DOCKER_STORAGE_DRIVER:-}
if [ -z "$storage_driver" ]; then
    probe=$(mktemp -d "$cache/overlay-probe.XXXXXX")
    mkdir "$probe"/{lower,upper,work,merged}
    if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
            "$probe/merged" 2> /dev/null; then
        umount "$probe/merged"
        storage_driver=overlay
    else
        storage_driver=vfs
    fi
    rm -rf "$probe"
fi
echo "storage driver: $storage_driver"
# Our own storage and run directories: nothing else's podman images are touched.
# cgroupfs: no systemd runs as PID 1 to manage cgroups; file events: no journald.
# runc: crun (podman's default) refuses a hybrid cgroup layout whose cgroup v2
# half has a controller enabled ("cgroups in hybrid mode not supported").
podman_=(podman --root "$cache/storage" --runroot /run/mpitrain-docker
         --storage-driver "$storage_driver" --cgroup-manager cgroupfs --events-backend file
         --runtime runc)
# Podman asks for nofile=1048576 and nproc=4194304 in a container, but podman
# itself first lowers its own nproc hard limit to 32768, and raising a hard
# limit needs CAP_SYS_RESOURCE, which root may lack (it does in a sandbox):
# ask for no more than this shell and podman have.
hard_nofile=$(ulimit -Hn)
hard_nproc=$(ulimit -Hu)
if [ "$hard_nproc" = unlimited ] || [ "$hard_nproc" -gt 32768 ]; then
    hard_nproc=32768
fi
ulimits=(--ulimit "nofile=$hard_nofile:$hard_nofile" --ulimit "nproc=$hard_nproc:$hard_nproc")

stage "base root file system ($suite, $mirror)"
base_tar="$cache/base-$suite.tar"
if [ ! -f "$base_tar" ]; then
    rm -rf "$cache/rootfs"
    timeout 900 debootstrap --variant=minbase --include="$base_packages" \
        "$suite" "$cache/rootfs" "$mirror" > "$cache/debootstrap.log"
    rm -rf "$cache"/rootfs/var/cache/apt/archives/*.deb "$cache"/rootfs/var/lib/apt/lists/*
    tar -C "$cache/rootfs" --numeric-owner -cf "$base_tar.part" .
    mv "$base_tar.part" "$base_tar"
    rm -rf "$cache/rootfs"
fi

stage "import as $base"
if ! "${podman_[@]}" image exists "$base"; then
    timeout 300 "${podman_[@]}" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
        "$base_tar" "$base" > /dev/null
fi

stage "build $image"
pip_conf="$cache/pip.conf"
build_args=()
echo "[global]" > "$pip_conf"
# `pip config list` prints scope.key='value', the environment's first; the
# first of each key wins, as pip's environment variables win over its files.
"$python" -m pip config list 2> /dev/null \
    | sed -nE "s/^[^.]*\.([a-z-]+)='(.*)'$/\1 = \2/p" | awk '!seen[$1]++' >> "$pip_conf" || true
# Words, not lines: extra-index-url holds several URLs.
# shellcheck disable=SC2013
for value in $(sed -n 's/^[a-z-]* = //p' "$pip_conf"); do
    path=$value
    # A local index's pages link to files beside it (../../files/...).
    [[ $value == file://* ]] && path=$(dirname "${value#file://}")
    if [[ $path == /* && -e $path ]]; then
        build_args+=(--volume "$path:$path:ro")
    fi
done
build_args+=(--volume "$pip_conf:/etc/pip.conf:ro")
# With a local index or wheel directory, torch's CPU build comes from there,
# not from PyTorch's index.
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
elif grep -qE '^(index-url|find-links) = ' "$pip_conf"; then
    index=$(sed -n 's/^index-url = //p' "$pip_conf")
    build_args+=(--build-arg "TORCH_INDEX_URL=${index:-https://pypi.org/simple}")
fi
echo "pip configuration seen by the build:"
sed 's/^/    /' "$pip_conf"
# --pull=never: FROM is the image imported above, never a registry's.
# --network=host: no CNI plugins (and no bridge on a shared machine); pip
# reaches its indexes through the host's network.
timeout 1200 "${podman_[@]}" build --pull=never --network=host "${ulimits[@]}" "${build_args[@]}" \
    -t "$image" "$repo" 2>&1 | elapsed
# The layers of earlier builds that this one no longer uses (GBs each).
timeout 300 "${podman_[@]}" image prune --force > /dev/null

stage "run the default command"
timeout 60 "${podman_[@]}" run --rm --network=host "${ulimits[@]}" "$image" id
timeout 600 "${podman_[@]}" run --rm --network=host "${ulimits[@]}" --shm-size=1g "$image" 2>&1 \
    | elapsed

stage "done"
