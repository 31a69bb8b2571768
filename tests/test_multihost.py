"""mpitrain jobs across hosts: network namespaces on this machine, so that
Open MPI starts a daemon per host and the ranks talk TCP between hosts
(devtools/hosts.py). Topology, every collective, the examples' accuracy, a rank
dying on one host, mpitrainrun's -H, --hostfile and --network-interface, and
host allreduces and allgathers with and without their hierarchical forms."""

import json
import os
import re
import subprocess
import sys

import pytest

from devtools.hosts import HostsUnavailable, namespace_hosts, run_on_hosts
from tests.mpi_harness import ROOT

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


@pytest.fixture(scope="module")
def hosts():
    version = (subprocess.run([MPIRUN, "--version"], capture_output=True, text=True).stdout
               if os.path.exists(MPIRUN) else "nothing: it is not there")
    if not re.search(r"Open MPI\) ([5-9]|\d\d)\.", version):
        pytest.skip(f"the hosts are started through Open MPI 5's launcher; {MPIRUN} "
                    f"says {version.strip()[:80]!r}")
    try:
        with namespace_hosts(3) as made:
            yield made
    except HostsUnavailable as reason:
        pytest.skip(str(reason))


def run(command, hosts, timeout, env=()):
    """Run a job with ``env`` added to mpirun's environment; a job still
    running after ``timeout`` seconds fails the test."""
    job = run_on_hosts(command, hosts, timeout, env)
    if job.returncode is None:
        pytest.fail(f"still running after {timeout} s: {' '.join(command)}\n"
                    f"--- stdout ---\n{job.stdout[-3000:]}\n--- stderr ---\n"
                    f"{job.stderr[-3000:]}")
    return job


def run_script(hosts, layout, script, *args, timeout=60, env=()):
    """Run tests/scripts/<script> with layout[i] ranks on host i through
    mpirun, which forwards ``env`` to every rank."""
    # No --oversubscribe: with it, Open MPI 5.0 fills the first host beyond
    # its slots (-H a:3,b:1 puts all 4 ranks on a). The hosts start from a
    # login's environment: pass on what the job needs.
    forwarded = [flag for name in ["OMP_NUM_THREADS", *dict(env)] for flag in ("-x", name)]
    command = [MPIRUN, "-np", str(sum(layout)), "-H", hosts.spec(*layout), *forwarded,
               sys.executable, os.path.join(SCRIPTS, script)]
    return run(command + list(args), hosts, timeout, env)


def succeeded(job):
    assert job.returncode == 0, (f"exit code {job.returncode}\n--- stdout ---\n"
                                 f"{job.stdout[-3000:]}\n--- stderr ---\n{job.stderr[-6000:]}")
    return job.stdout


def topology_reports(stdout):
    """Every rank's TOPOLOGY line, in rank order."""
    reports = [json.loads(line) for line in re.findall(r"TOPOLOGY (\{.*\})", stdout)]
    return sorted(reports, key=lambda report: report["rank"])


def expected_topology(hosts, layout):
    """What each rank should report when host i runs layout[i] ranks, filled
    host by host, as -H hands out slots."""
    expected = []
    for host, count in enumerate(layout):
        for local_rank in range(count):
            # Horovod's cross communicator: the ranks with the same local rank.
            peers = [other for other, slots in enumerate(layout) if slots > local_rank]
            expected.append({
                "hostname": hosts.hostnames[host],
                "rank": len(expected), "size": sum(layout),
                "local_rank": local_rank, "local_size": count,
                "cross_rank": peers.index(host), "cross_size": len(peers),
                "is_homogeneous": len(set(layout)) == 1,
                "sum_of_ranks": sum(range(sum(layout)))})
    return expected


def without(reports, key):
    return [{k: v for k, v in report.items() if k != key} for report in reports]


@pytest.mark.parametrize("layout", [(3, 1), (1, 2, 1)], ids=["3+1", "1+2+1"])
def test_topology_across_hosts(hosts, layout):
    reports = topology_reports(succeeded(run_script(hosts, layout, "multihost_topology.py")))
    assert without(reports, "fusion_threshold") == expected_topology(hosts, layout)


def test_every_collective_across_hosts(hosts):
    stdout = succeeded(run_script(hosts, (2, 2), "multihost_collectives.py",
                                  hosts.interface))
    assert sorted(re.findall(r"collectives right on rank (\d)", stdout)) == list("0123")


def final_accuracy(stdout):
    """The accuracy an example's rank 0 prints last: "test accuracy: 0.97"."""
    accuracies = re.findall(r"test accuracy: (\d\.\d\d)$", stdout, flags=re.M)
    assert len(accuracies) == 1, stdout[-2000:]
    return float(accuracies[0])


@pytest.mark.parametrize("example", ["pytorch_digits.py", "keras_digits.py"])
def test_an_example_learns_as_well_on_two_hosts_as_on_one(hosts, example):
    """Every rank starts from rank 0's weights and the shards depend only on
    the rank count, so the runs are the same up to the order of additions:
    the accuracy, printed to two places, is the same."""
    program = [sys.executable, os.path.join(ROOT, "examples", example)]
    two_hosts = succeeded(run([LAUNCHER, "-np", "4", "-H", hosts.spec(2, 2), *program],
                              hosts, timeout=180))
    one_host = succeeded(run([LAUNCHER, "-np", "4", *program], hosts, timeout=180))
    assert final_accuracy(two_hosts) == final_accuracy(one_host) >= 0.9


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_rank_dying_on_one_host_ends_the_job_on_every_host(hosts, how):
    # rank 3 runs on the second host; a job that outlives it fails at the timeout
    job = run_script(hosts, (2, 2), "multihost_failure.py", how, timeout=60)
    assert f"rank 3 dies by {how} at step 20" in job.stdout, job.stderr[-3000:]
    assert job.returncode != 0
    assert hosts.wait_until_empty(seconds=10), f"left running: {hosts.processes()}"


def launch(hosts, *flags):
    """mpitrainrun FLAGS python multihost_topology.py: every rank's report."""
    command = [LAUNCHER, *flags, sys.executable,
               os.path.join(SCRIPTS, "multihost_topology.py")]
    return topology_reports(succeeded(run(command, hosts, timeout=60)))


def test_launcher_with_hosts_forwards_the_settings_to_every_host(hosts):
    reports = launch(hosts, "-np", "4", "-H", hosts.spec(2, 2), "--fusion-threshold-mb", "32")
    assert without(reports, "fusion_threshold") == expected_topology(hosts, (2, 2))
    assert [report["fusion_threshold"] for report in reports] == [str(32 << 20)] * 4


def test_launcher_with_a_hostfile(hosts, tmp_path):
    hostfile = tmp_path / "hostfile"
    first, second, third = hosts.addresses
    hostfile.write_text(f"# three hosts\n{first} slots=1\n{second}:2\n{third}\n")
    reports = launch(hosts, "-np", "4", "--hostfile", str(hostfile))
    assert without(reports, "fusion_threshold") == expected_topology(hosts, (1, 2, 1))


def test_launcher_keeps_the_job_to_the_network_interface_given(hosts):
    reports = launch(hosts, "-np", "4", "-H", hosts.spec(2, 2),
                     "--network-interface", hosts.interface)
    assert without(reports, "fusion_threshold") == expected_topology(hosts, (2, 2))
    # Open MPI refuses to start on an interface that is not there: the flag
    # reaches it.
    job = run([LAUNCHER, "-np", "4", "-H", hosts.spec(2, 2), "--network-interface",
               "nosuch0", sys.executable, "-c", "pass"], hosts, timeout=60)
    assert job.returncode != 0 and "No network interfaces were found" in job.stderr


# mpitrainrun's prefix of a rank's output lines, "[1,RANK]<stdout>: "
TAG = r"(?:\[\d+,\d+\]<std\w+>: )?"


def routes(stdout):
    """How each rank of multihost_hierarchical.py says its host allreduces
    travel, in rank order."""
    said = dict(re.findall(rf"^{TAG}ROUTE (\d+): (.*)$", stdout, flags=re.M))
    return [said.get(str(rank)) for rank in range(4)]


def allreduces_right(stdout):
    assert sorted(re.findall(r"allreduces right on rank (\d)", stdout)) == list("0123"), \
        stdout[-3000:]


HIERARCHICAL = "MPITRAIN_HIERARCHICAL_ALLREDUCE"
# (what mpirun forwards, the route every rank must report: a pattern)
ROUTES = {
    "flat": ({}, re.escape("MPI's allreduce across nodes")),
    "hierarchical, shared memory inside": (
        {HIERARCHICAL: "1", "MPITRAIN_INTRA_NODE": "auto"},
        r"hierarchical: shared memory in /dev/shm .* inside each of 2 nodes, "
        r"MPI across them"),
    # Horovod's name for the setting works too
    "hierarchical, MPI inside": (
        {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "MPITRAIN_INTRA_NODE": "mpi"},
        re.escape("hierarchical: MPI inside each of 2 nodes, "
                  "MPI across them")),
}


def all_match(pattern, said):
    return all(text is not None and re.fullmatch(pattern, text) for text in said)


@pytest.mark.parametrize("route", list(ROUTES))
def test_host_allreduces_match_numpy_with_and_without_hierarchical(hosts, route):
    env, route_pattern = ROUTES[route]
    stdout = succeeded(run_script(hosts, (2, 2), "multihost_hierarchical.py",
                                  env=env, timeout=120))
    said = routes(stdout)
    assert all_match(route_pattern, said), said
    allreduces_right(stdout)


def test_launcher_flag_turns_hierarchical_allreduce_on_on_every_host(hosts):
    command = [LAUNCHER, "-np", "4", "-H", hosts.spec(2, 2), "--hierarchical-allreduce",
               sys.executable, os.path.join(SCRIPTS, "multihost_hierarchical.py")]
    # Off in the launcher's own environment: only the flag can turn it on.
    stdout = succeeded(run(command, hosts, timeout=120, env={HIERARCHICAL: "0"}))
    said = routes(stdout)
    assert all_match(ROUTES["hierarchical, shared memory inside"][1], said), said
    allreduces_right(stdout)


def test_hierarchical_allreduce_on_uneven_hosts_warns_and_uses_mpi(hosts):
    # Through the launcher, whose output tags show the rank of each line, and
    # with every rank logging warnings, so a warning from any rank but 0 shows.
    command = [LAUNCHER, "-np", "4", "-H", hosts.spec(3, 1), "--hierarchical-allreduce",
               "--log-level", "warning", sys.executable,
               os.path.join(SCRIPTS, "multihost_hierarchical.py")]
    job = run(command, hosts, timeout=120)
    allreduces_right(succeeded(job))
    why = ("hierarchical allreduce needs the same number of ranks on every node, "
           "and these nodes have [1, 3]")
    assert routes(job.stdout) == [f"MPI's allreduce ({why})"] * 4
    warned = re.findall(rf"^\[\d+,(\d+)\]<stderr>: .*{re.escape(why)}", job.stderr,
                        flags=re.M)
    assert warned == ["0"], job.stderr[-3000:]


def gathers(stdout):
    """How each rank of multihost_allgather.py says its allgathers travel, and
    whether every rank found its results right."""
    said = dict(re.findall(rf"^{TAG}GATHER (\d+): (.*)$", stdout, flags=re.M))
    right = sorted(re.findall(r"allgathers right on rank (\d)", stdout))
    return [said.get(str(rank)) for rank in range(4)], right == list("0123")


# (hosts' layout, how mpirun places ranks, what mpirun forwards, the route)
GATHERS = {
    "flat": ((2, 2), "slot", {}, "MPI"),
    "hierarchical": ((2, 2), "slot", {"MPITRAIN_HIERARCHICAL_ALLGATHER": "1"},
                     "hierarchical"),
    # ranks 0 and 2 on one host, 1 and 3 on the other: the nodes' parts
    # arrive in another order than the ranks'
    "hierarchical, alternating hosts": ((2, 2), "node",
                                        {"HOROVOD_HIERARCHICAL_ALLGATHER": "1"},
                                        "hierarchical"),
    "hierarchical, uneven hosts": ((3, 1), "slot", {"MPITRAIN_HIERARCHICAL_ALLGATHER": "1"},
                                   "hierarchical"),
}


@pytest.mark.parametrize("case", list(GATHERS))
def test_allgathers_match_with_and_without_hierarchical(hosts, case):
    layout, mapping, env, route = GATHERS[case]
    forwarded = [flag for name in env for flag in ("-x", name)]
    command = [MPIRUN, "-np", "4", "-H", hosts.spec(*layout), "--map-by", mapping,
               *forwarded, sys.executable, os.path.join(SCRIPTS, "multihost_allgather.py")]
    said, right = gathers(succeeded(run(command, hosts, timeout=120, env=env)))
    assert said == [route] * 4, said
    assert right


def test_launcher_flag_turns_hierarchical_allgather_on_on_every_host(hosts):
    command = [LAUNCHER, "-np", "4", "-H", hosts.spec(2, 2), "--hierarchical-allgather",
               sys.executable, os.path.join(SCRIPTS, "multihost_allgather.py")]
    stdout = succeeded(run(command, hosts, timeout=120,
                           env={"MPITRAIN_HIERARCHICAL_ALLGATHER": "0"}))
    assert gathers(stdout) == (["hierarchical"] * 4, True), stdout[-3000:]
