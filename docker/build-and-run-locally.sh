#!/usr/bin/env bash
# Builds an image of mpitrain and runs a command in it, with the container
# engine this machine has:
#   docker/build-and-run-locally.sh             # Dockerfile; its CMD trains on 2 ranks
#   docker/build-and-run-locally.sh mpitrainrun -np 2 python examples/keras_digits.py
#   docker/build-and-run-locally.sh --gpu       # Dockerfile.gpu; its CMD is --check-build
#   docker/build-and-run-locally.sh --engine    # which engine it would use, or why none
# The engine: docker where its daemon answers, else podman as root (on Debian,
# docker/install-engine.sh installs podman, runc and debootstrap). This script
# installs nothing.
# The base image (python:3.11-slim-bookworm): the engine's own copy, else
# pulled, else, where no registry can be reached, made here as root: Debian
# bookworm by debootstrap with the Python 3.11 that image has, imported under
# its name.
# Caches: podman's storage (base, layers, images) and the debootstrapped base
# stay under $MPITRAIN_DOCKER_CACHE (default /var/cache/mpitrain-docker), so a
# second run only rebuilds what changed; delete that directory to start from
# nothing. docker keeps its images where its daemon does.
# With podman, pip inside the build sees this machine's pip configuration
# (indexes, find-links, certificate: bind-mounted read-only, never copied
# into the image).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${MPITRAIN_DOCKER_CACHE:-/var/cache/mpitrain-docker}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
python=${PYTHON:-python3}

die() {
    echo "build-and-run-locally: $*" >&2
    exit 1
}
stage() {
    echo "== $1 (after $SECONDS s)"
}
# Each line prefixed by the seconds since the script began.
elapsed() {
    while IFS= read -r line; do printf '[%4d s] %s\n' "$SECONDS" "$line"; done
}

# The engine's name, or why there is none (exit status 1).
choose_engine() {
    if [ -n "${MPITRAIN_CONTAINER_ENGINE:-}" ]; then
        echo "$MPITRAIN_CONTAINER_ENGINE"
    elif timeout 30 docker info > /dev/null 2>&1; then
        echo docker
    elif ! command -v podman > /dev/null; then
        echo "no container engine: no docker with a running daemon, no podman" \
             "(on Debian, as root: docker/install-engine.sh)"
        return 1
    elif [ "$(id -u)" != 0 ]; then
        echo "podman needs root here: its storage is $cache"
        return 1
    elif ! command -v runc > /dev/null; then
        echo "podman runs its containers with runc here, which is missing" \
             "(on Debian, as root: docker/install-engine.sh)"
        return 1
    else
        echo podman
    fi
}

gpu=0
case "${1:-}" in
    --engine)
        choose_engine
        exit ;;
    --gpu)
        gpu=1
        shift ;;
    -*)
        die "unknown option $1 (--gpu, --engine; a command's own options follow it)" ;;
esac
engine=$(choose_engine) || die "$engine"
if [ "$gpu" = 1 ]; then
    dockerfile=$repo/Dockerfile.gpu
    tag=gpu
else
    dockerfile=$repo/Dockerfile
    tag=local
fi
image=${MPITRAIN_DOCKER_IMAGE:-localhost/mpitrain:$tag}
base=$(awk 'toupper($1) == "FROM" {print $2; exit}' "$dockerfile")
suite=${base##*-}                      # python:3.11-slim-bookworm -> bookworm
echo "engine: $engine; image: $image from $(basename "$dockerfile")"

run_flags=(--rm --shm-size=1g)
build_flags=()
if [ "$engine" = podman ]; then
    mkdir -p "$cache"
    exec 9> "$cache/lock"              # one run at a time per cache
    flock -w 3600 9
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
    echo "storage driver: $storage_driver, under $cache"
    # Our own storage and run directories: nothing else's podman images are touched.
    # cgroupfs: no systemd runs as PID 1 to manage cgroups; file events: no journald.
    # runc: crun (podman's default) refuses a hybrid cgroup layout whose cgroup v2
    # half has a controller enabled ("cgroups in hybrid mode not supported").
    engine_=(podman --root "$cache/storage" --runroot /run/mpitrain-docker
             --storage-driver "$storage_driver" --cgroup-manager cgroupfs
             --events-backend file --runtime runc)
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
    # --network=host: without recommends Debian's podman has no CNI plugins
    # (and no bridge on a shared machine); pip reaches its indexes through
    # the host's network. --pull=never: FROM is the base found or made below.
    build_flags+=(--pull=never --network=host "${ulimits[@]}")
    run_flags+=(--network=host "${ulimits[@]}")
    # GPUs reach a podman container through the NVIDIA Container Toolkit's CDI.
    gpu_flags=(--device nvidia.com/gpu=all)
else
    engine_=(docker)
    gpu_flags=(--gpus all)
fi
# Untried: no machine here has a GPU (docs/docker.md).
if [ "$gpu" = 1 ] && nvidia-smi -L > /dev/null 2>&1; then
    run_flags+=("${gpu_flags[@]}")
fi

stage "base image $base"
if "${engine_[@]}" image inspect "$base" > /dev/null 2>&1; then
    echo "found in $engine's storage"
elif pulled=$(timeout 600 "${engine_[@]}" pull "docker.io/library/$base" 2>&1); then
    tail -n 3 <<< "$pulled"
    [ "$engine" = docker ] || "${engine_[@]}" tag "docker.io/library/$base" "$base"
else
    # Expected where no registry can be reached (the development machines):
    # the way taken first, then why, in the engine's words less its "Error: ".
    echo "no registry to pull it from: making it with debootstrap ($suite, $mirror)"
    echo "($engine pull: $(tail -n 1 <<< "$pulled" | sed 's/^Error: //'))"
    command -v debootstrap > /dev/null && [ "$(id -u)" = 0 ] \
        || die "no $base to pull, and making it needs root and debootstrap" \
               "(on Debian, as root: docker/install-engine.sh)"
    # python:3.11-slim-bookworm's own Python comes from python.org's sources;
    # in Debian bookworm it is python3 (3.11), `python` is python-is-python3,
    # and `python -m venv` needs python3-venv.
    base_packages=python3,python3-venv,python-is-python3,ca-certificates,netbase
    mkdir -p "$cache"
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
    timeout 300 "${engine_[@]}" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
        "$base_tar" "$base" > /dev/null
fi

stage "build $image"
if [ "$engine" = podman ]; then
    pip_conf="$cache/pip.conf"
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
            build_flags+=(--volume "$path:$path:ro")
        fi
    done
    build_flags+=(--volume "$pip_conf:/etc/pip.conf:ro")
    # With a local index or wheel directory, the CPU image's torch comes from
    # there, not from PyTorch's index.
    if [ "$gpu" = 0 ] && [ -n "${TORCH_INDEX_URL:-}" ]; then
        build_flags+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    elif [ "$gpu" = 0 ] && grep -qE '^(index-url|find-links) = ' "$pip_conf"; then
        index=$(sed -n 's/^index-url = //p' "$pip_conf")
        build_flags+=(--build-arg "TORCH_INDEX_URL=${index:-https://pypi.org/simple}")
    fi
    echo "pip configuration seen by the build:"
    sed 's/^/    /' "$pip_conf"
fi
timeout 3600 "${engine_[@]}" build "${build_flags[@]}" -f "$dockerfile" -t "$image" "$repo" 2>&1 \
    | elapsed
# The layers of earlier builds that this one no longer uses (GBs each).
timeout 300 "${engine_[@]}" image prune --force > /dev/null

if [ $# -gt 0 ]; then
    stage "run $*"
else
    stage "run the image's command"
fi
timeout 900 "${engine_[@]}" run "${run_flags[@]}" "$image" "$@" 2>&1 \
    | elapsed
stage "done"
