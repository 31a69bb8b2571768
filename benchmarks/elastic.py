"""Elastic training's costs: a commit against a step, and a lost host's restart.

Run as root (it makes network namespaces as hosts, devtools/hosts.py):

    python benchmarks/elastic.py [--params 100] [--steps 14] [--kill-at 10]

Two hosts, one rank each, train an MLP of --params million parameters with
Adam (benchmarks/elastic_job.py) under mpitrainrun's elastic mode,
committing after every step from step 6 on. At the start of step --kill-at
the rank of the second host SIGKILLs itself; the job goes on with one rank
from its last commit. Printed: a step without commits, a step while each
step commits (the write of the one before runs beside it), the time
commit() holds the training thread, the time one commit's write takes
alone (to /dev/shm: pickling, SHA-256, the copy), and the time from the
kill to the end of the first step after the restart, in its parts.
"""

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from devtools.hosts import namespace_hosts, run_on_hosts  # noqa: E402

LAUNCHER = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
JOB = os.path.join(ROOT, "benchmarks", "elastic_job.py")


def events(output):
    """Every EVENT line of the job, in order."""
    return [json.loads(found) for found in re.findall(r"EVENT (\{.*\})", output)]


def run(hosts, arguments, timeout):
    with tempfile.TemporaryDirectory() as folder:
        discover = os.path.join(folder, "hosts.sh")
        with open(discover, "w") as script:
            script.write("#!/bin/sh\n" + "".join(f"echo {address}:1\n"
                                                for address in hosts.addresses))
        os.chmod(discover, 0o755)
        job = run_on_hosts([LAUNCHER, "-np", "2", "--min-np", "1", "--host-discovery-script",
                            discover, sys.executable, JOB, *arguments], hosts, timeout)
    if job.returncode is None or job.returncode:
        sys.exit(f"the job failed ({job.returncode or 'timed out'})\n{job.stdout[-3000:]}\n"
                 f"{job.stderr[-3000:]}")
    return job.stdout, job.stderr


def median(values):
    return f"{statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"


def report(said, first_commit):
    killed = next(e["time"] for e in said if e["event"] == "killed")
    restarted = next(e for e in said if e["event"] == "started" and e["restarts"] == 1)
    first_run = [e for e in said if e["time"] < killed]
    second = [e for e in said if e["time"] >= restarted["at"]]
    steps = [e for e in first_run if e["event"] == "step"]
    plain = [e["seconds"] for e in steps[1:] if not e["committed"]]
    overlapped = [e["seconds"] for e in steps if e["committed"] and e["step"] > first_commit]
    calls = [e["commit_call"] for e in steps if e["committed"] and e["step"] > first_commit]
    written = next(e["seconds"] for e in first_run if e["event"] == "written")
    started = first_run[0]
    print(f"{started['parameters'] / 1e6:.1f}M parameters (Adam: model and state "
          f"{started['parameters'] * 12 / 2**30:.2f} GiB), {started['ranks']} ranks")
    print(f"  step, no commits:                  {median(plain)}")
    print(f"  step, a commit after each:         {median(overlapped)}")
    print(f"  commit() on the training thread:   {median(calls)}")
    print(f"  one commit's write alone:          {written:.2f} s")
    resumed = next(e for e in second if e["event"] == "resumed")
    stepped = next(e for e in second if e["event"] == "step")
    print(f"host lost -> first step after the restart: {stepped['time'] - killed:.1f} s")
    print(f"  end of the run, new mpirun, Python starts:  {restarted['at'] - killed:.1f} s")
    print(f"  imports, model, init():                     "
          f"{restarted['time'] - restarted['at']:.1f} s")
    print(f"  the newest commit found, read, loaded:      "
          f"{resumed['time'] - restarted['time']:.1f} s (resumed at step {resumed['step']})")
    print(f"  the first step:                             "
          f"{stepped['time'] - resumed['time']:.1f} s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", default="100")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=1800)
    args = parser.parse_args()
    first_commit = 6
    with namespace_hosts(2) as hosts:
        try:
            out, _ = run(hosts, ["--params", args.params, "--steps", str(args.steps),
                                 "--kill-at", str(args.kill_at), "--first-commit",
                                 str(first_commit)], args.timeout)
        finally:
            # The lost host keeps its commit, as a real one would: remove it.
            for name in hosts.hostnames:
                for folder in glob.glob(f"/dev/shm/mpitrain-elastic-*/{name}"):
                    shutil.rmtree(os.path.dirname(folder), ignore_errors=True)
    report(events(out), first_commit)


if __name__ == "__main__":
    main()
