# Sourced by the set-up scripts (docker/install-engine.sh, devtools/install-slurm.sh):
# apt_install TAG HINT PACKAGE... installs the packages named and what they depend on,
# and nothing else: no recommended packages, and no upgrade of a package already
# installed. It says which packages it installs before it does.
# Needs root and apt-get (Debian, Ubuntu); otherwise it says so, adds HINT (what
# to do elsewhere) and ends the script.
apt_install() {
    local tag=$1 hint=$2
    shift 2
    if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
        echo "$tag: installing $* needs root and apt-get (Debian, Ubuntu); $hint" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-upgrade keeps any package already installed as it is. apt also
    # upgrades every installed package built from the same source as one it
    # installs (libsubid4, which podman needs, upgraded login and passwd);
    # Upgrade-By-Source-Package=false turns that off.
    local flags=(-y -qq --no-install-recommends --no-upgrade
                 -o APT::Get::Upgrade-By-Source-Package=false)
    # apt-get -s: what it would do, one "Inst PACKAGE (VERSION ...)" line a package.
    local new
    new=$(apt-get -s "${flags[@]}" install "$@" \
          | awk '$1 == "Inst" {names = names " " $2} END {print names}')
    echo "$tag: installing$new"
    apt-get "${flags[@]}" install "$@" > /dev/null
}
