#!/usr/bin/env bash
# Set-up, run once by hand or by .ci/run: installs Debian's Slurm (slurm-wlm:
# slurmctld, slurmd and the clients), munge (its authentication), libpmix2
# and libpmix-dev (for `srun --mpi=pmix`), as root, so that
# tests/test_slurm.py starts a one-machine Slurm from a scratch folder
# (devtools/slurm.py) instead of skipping. About 15 s. Installing starts no
# daemon: the test starts and stops its own.
set -euo pipefail

PMIX=/usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so
if command -v slurmctld > /dev/null && command -v slurmd > /dev/null \
        && command -v munged > /dev/null && command -v sbatch > /dev/null \
        && [ -e "$PMIX" ]; then
    echo "install-slurm: slurmctld, slurmd, munged, sbatch and libpmix are installed"
    exit 0
fi
# shellcheck source=apt-install.sh
. "$(dirname "$0")/apt-install.sh"
# policy-rc.d: where a service manager runs, the packages' scripts would start
# the daemons with the system's configuration; the test runs its own.
if [ "$(id -u)" = 0 ] && [ ! -e /usr/sbin/policy-rc.d ]; then
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
fi
# Slurm's mpi/pmix plugin opens pmix2/lib/libpmix.so, the name only
# libpmix-dev installs; with libpmix2 alone, `srun --mpi=pmix` fails with
# "Couldn't load specified plugin name for mpi/pmix: Plugin init() callback failed".
apt_install install-slurm "elsewhere the Slurm tests skip" \
    slurm-wlm munge libpmix2 libpmix-dev
echo "install-slurm: installed $(slurmctld -V)"
