"""Hierarchical against flat allreduce on 2 hosts x 2 ranks, over a rate-limited link.

Run as root (it makes network namespaces as hosts, devtools/hosts.py):

    python benchmarks/hierarchical_allreduce.py [--rate 1gbit] [--sizes-mib 4 16 64]
                                                [--repetitions 5] [--rounds 2]

Each host's link to the bridge between them is limited with tbf in both
directions (netem is not in every kernel), and the throughput one TCP stream
achieves over it is measured and printed; then everything again without the
limit. Under each condition, every route runs as a job of its own (the
setting is per job), the routes taking turns for --rounds rounds:
  flat                  MPI's allreduce across all ranks;
  hierarchical, shm     MPITRAIN_HIERARCHICAL_ALLREDUCE=1 (shared memory inside
                        each host, MPITRAIN_INTRA_NODE=auto);
  hierarchical, MPI     the same with MPITRAIN_INTRA_NODE=mpi.
Each job times mpitrain.allreduce of one float32 tensor of each size, in
place, and MPI.COMM_WORLD.Allreduce of the same bytes, taking turns within
each repetition (benchmarks/hierarchical_allreduce_job.py). Figures are the
slowest rank's, medians with their range (min-max) over every repetition of
every round; mpitrain / raw is taken per repetition, against the raw call of
the same repetition; route / flat over every pairing of the route's
repetitions with the flat route's (they ran in different jobs).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from devtools.hosts import namespace_hosts, run_on_hosts  # noqa: E402

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
JOB = os.path.join(ROOT, "benchmarks", "hierarchical_allreduce_job.py")
ROUTES = {
    "flat": {},
    "hierarchical, shm": {"MPITRAIN_HIERARCHICAL_ALLREDUCE": "1",
                          "MPITRAIN_INTRA_NODE": "auto"},
    "hierarchical, MPI": {"MPITRAIN_HIERARCHICAL_ALLREDUCE": "1",
                          "MPITRAIN_INTRA_NODE": "mpi"},
}
# What every rank's engine must report for each route: a job that silently
# fell back to another route would time the wrong thing.
EXPECTED = {"flat": "MPI's allreduce across nodes",
            "hierarchical, shm": "hierarchical: shared memory",
            "hierarchical, MPI": "hierarchical: MPI inside each"}
PORT = 5201

RECEIVER = f"""
import socket, time
server = socket.create_server(("", {PORT}))
connection, _ = server.accept()
received, started = 0, None
while data := connection.recv(1 << 20):
    started = started or time.perf_counter()
    received += len(data)
print(received * 8 / (time.perf_counter() - started) / 1e9)
"""
SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], {port})) as connection:
    for _ in range(int(sys.argv[2])):
        connection.sendall(bytes(1 << 20))
""".format(port=PORT)


def in_host(hosts, index, *command):
    return ["ip", "netns", "exec", hosts.namespaces[index], *command]


def limit(hosts, rate):
    """tbf at ``rate`` on both ends of every host's veth; None removes it. The
    burst is what 1 Gbit/s passes in 2 ms: smaller ones lose throughput there."""
    ends = []
    for index in range(len(hosts.namespaces)):
        ends += [(in_host(hosts, index, "tc"), hosts.interface),
                 (["tc"], f"{hosts.tag}v{index}")]
    for tc, device in ends:
        if rate:
            subprocess.run([*tc, "qdisc", "replace", "dev", device, "root", "tbf", "rate",
                            rate, "burst", "256kb", "latency", "20ms"],
                           check=True, capture_output=True)
        else:
            subprocess.run([*tc, "qdisc", "del", "dev", device, "root"], capture_output=True)


def link_gbits(hosts, mib=200):
    """Gbit/s one TCP stream achieves from host 0 to host 1."""
    receiver = subprocess.Popen(in_host(hosts, 1, sys.executable, "-c", RECEIVER),
                                stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(50):             # until the receiver listens
            sent = subprocess.run(in_host(hosts, 0, sys.executable, "-c", SENDER,
                                          hosts.addresses[1], str(mib)),
                                  capture_output=True, timeout=120)
            if sent.returncode == 0:
                break
            time.sleep(0.1)
        return float(receiver.communicate(timeout=60)[0])
    finally:
        receiver.kill()


def run_job(hosts, route, args):
    """One job of 2 hosts x 2 ranks on ``route``: its RESULT."""
    env = ROUTES[route]
    forwarded = [flag for name in ["OMP_NUM_THREADS", *env] for flag in ("-x", name)]
    command = [MPIRUN, "-np", "4", "-H", hosts.spec(2, 2), *forwarded, sys.executable,
               JOB, *map(str, args.sizes_mib), "--repetitions", str(args.repetitions)]
    job = run_on_hosts(command, hosts, args.job_timeout, env)
    if job.returncode is None:
        raise SystemExit(f"{route}: still running after {args.job_timeout} s")
    out, err = job.stdout, job.stderr
    found = re.search(r"^RESULT (\{.*\})$", out, flags=re.M)
    if job.returncode or not found:
        raise SystemExit(f"{route}: exit code {job.returncode}\n{out[-2000:]}\n{err[-3000:]}")
    result = json.loads(found.group(1))
    if not all(said.startswith(EXPECTED[route]) for said in result["routes"]):
        raise SystemExit(f"{route}: the ranks took {result['routes']}")
    return result


def condition(hosts, rate, args):
    """Under ``rate`` (None: no limit): the link's Gbit/s, the seconds of every
    repetition, {route: {size: {"mpitrain": [...], "raw": [...]}}}, and what
    each route's ranks reported."""
    limit(hosts, rate)
    gbits = link_gbits(hosts)
    times = {route: {size: {"mpitrain": [], "raw": []} for size in args.sizes_mib}
             for route in ROUTES}
    descriptions = {}
    for _ in range(args.rounds):
        for route in ROUTES:
            result = run_job(hosts, route, args)
            descriptions[route] = result["routes"][0]
            for size, variants in result["times"].items():
                for variant, seconds in variants.items():
                    times[route][int(size)][variant] += seconds
    return gbits, times, descriptions


def median_and_range(values, digits=2, unit=""):
    """'median (min-max)' of values."""
    return (f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def table(title, gbits, times, descriptions, args):
    lines = [f"{title}: one TCP stream between the hosts gets {gbits:.2f} Gbit/s. "
             f"Medians of {args.rounds} rounds x {args.repetitions} repetitions "
             "(min-max in brackets).", "",
             "| size | route | mpitrain, ms | raw Allreduce, ms | mpitrain / raw "
             "| mpitrain / flat mpitrain |", "|---|---|---|---|---|---|"]
    for size in args.sizes_mib:
        flat = times["flat"][size]["mpitrain"]
        for route, by_size in times.items():
            ours, raw = by_size[size]["mpitrain"], by_size[size]["raw"]
            against_flat = ("" if route == "flat" else median_and_range(
                [mine / theirs for mine in ours for theirs in flat], unit="x"))
            lines.append(
                f"| {size} MiB | {route} | {median_and_range([t * 1e3 for t in ours], 1)} "
                f"| {median_and_range([t * 1e3 for t in raw], 1)} "
                f"| {median_and_range([a / b for a, b in zip(ours, raw)], unit='x')} "
                f"| {against_flat} |")
    lines += [""] + [f"{route}: {said}" for route, said in descriptions.items()]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="1gbit", help="tc's rate of each link")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--job-timeout", type=float, default=300)
    args = parser.parse_args()
    lines = [f"2 hosts x 2 ranks (network namespaces on one machine of "
             f"{os.cpu_count()} cores)", ""]
    with namespace_hosts(2) as hosts:
        for title, rate in ((f"Links limited to {args.rate}", args.rate),
                            ("No limit", None)):
            lines += table(title, *condition(hosts, rate, args), args) + [""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
