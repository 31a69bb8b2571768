"""Run test bodies under a real ``mpirun`` and report each one to pytest.

A test written as::

    @mpi_test(np=(2, 3))
    def test_something():
        ...                      # runs on every rank of an MPI job

becomes one pytest test per rank count. All tests of a module that share
the options run in one ``mpirun`` job, one after another in the order the
module defines them, with a barrier between them; the job has a timeout, so
a hang fails instead of hanging.

A body run once for each of several values (tests/bad_input_table.py runs
each case on each framework so)::

    @mpi_test(over=("numpy", "torch"))
    def test_something(name):    # called with "numpy", then with "torch"
        ...

becomes one pytest test per (value, rank count): test_something[torch-np2].
The values run one after another in the same job, each reported on its own;
in the job the test is named test_something[torch].

A body run under several environments (tests/test_gpu.py runs each on every
route a device buffer can take so)::

    @mpi_test(envs={"staged": {...}, "nccl": {...}})
    def test_something():

becomes one pytest test per (environment, rank count): test_something[nccl-np2],
each environment's tests in a job of their own.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from devtools.mpi_jobs import ROOT, job_environment, kill_session, mpirun_command


def mpi_test(np=(2, 3), env=None, timeout=30, init=True, skip=None, over=None,
             envs=None):
    """Mark a function to run on every rank of an mpirun job of ``np`` ranks.

    env: extra environment variables for the job; envs instead: {name: env}
    to run the body once in each; init: call mpitrain.init() before the test
    (False: the test starts mpitrain itself); skip: a function of (rank
    count, the job's environment) that returns why this machine cannot run
    the test, or None. A body may also call pytest.skip() on every rank.
    over: strings (without brackets) to call the body with, one after another.
    """
    variants = {None: env or {}} if envs is None else envs

    def decorate(body):
        runs = [(variant, value, nprocs) for variant in variants
                for value in over or (None,) for nprocs in np]
        ids = ["-".join([str(part) for part in (variant, value) if part is not None]
                        + [f"np{n}"]) for variant, value, n in runs]

        @pytest.mark.parametrize("variant, value, nprocs", runs, ids=ids)
        def test(variant, value, nprocs, mpi_jobs, request):
            reason = _skip_reason(test, variant, nprocs)
            if reason:
                pytest.skip(reason)
            mpi_jobs.check(request.module, body.__name__, variant, nprocs, value)

        test.__name__ = test.__qualname__ = body.__name__
        test.__doc__ = body.__doc__
        test.mpi_body = body
        test.mpi_rank_counts = np
        test.mpi_labels = [_label(body.__name__, value) for value in over or (None,)]
        test.mpi_variants = {variant: (tuple(sorted(variant_env.items())), timeout, init)
                             for variant, variant_env in variants.items()}
        test.mpi_skip = skip
        return test
    return decorate


def _label(name, value):
    """A test's name in its job: the name, and [value] for a value of over."""
    return name if value is None else f"{name}[{value}]"


def run_labelled(module, label):
    """Inside a job: run the body of the test ``label`` names (see _label)."""
    name, _, value = label.partition("[")
    body = getattr(module, name).mpi_body
    return body(value[:-1]) if value else body()


def _skip_reason(test, variant, nprocs):
    if test.mpi_skip is None:
        return None
    return test.mpi_skip(nprocs, job_environment(dict(test.mpi_variants[variant][0])))


# Open MPI's launcher now and then fails to start before any rank runs (seen
# under load); that says nothing about the code under test, so such a job
# is started once more.
_LAUNCHER_FAILURES = ("The PMIx server's listener thread failed to start",)


def failed_to_start(job):
    """Did Open MPI's launcher fail before any rank ran (start it once more)?"""
    return bool(job.returncode) and any(failure in job.stderr
                                        for failure in _LAUNCHER_FAILURES)


def run_mpi(nprocs, args, env=(), timeout=60):
    """Run ``python args...`` on nprocs ranks; returns CompletedProcess.

    A job still running after ``timeout`` seconds is killed and reported
    with returncode None.
    """
    job = _run_once(nprocs, args, env, timeout)
    if failed_to_start(job):
        job = _run_once(nprocs, args, env, timeout)
    return job


def _run_once(nprocs, args, env, timeout):
    command = mpirun_command(nprocs) + [sys.executable] + list(args)
    process = subprocess.Popen(command, cwd=ROOT, env=job_environment(env),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(command, process.returncode, out, err)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        out, err = process.communicate()
        return subprocess.CompletedProcess(command, None, out, err)


class Jobs:
    """Runs each module's tests once per (rank count, options) and keeps the results."""

    def __init__(self):
        self._results = {}

    def check(self, module, name, variant, nprocs, value=None):
        options = getattr(module, name).mpi_variants[variant]
        key = (module.__file__, nprocs, options)
        if key not in self._results:
            self._results[key] = self._run(module, nprocs, options)
        results, job = self._results[key]
        per_rank = [r.get(_label(name, value)) for r in results]
        failures = [f"--- rank {rank} ---\n{r['message']}"
                    for rank, r in enumerate(per_rank)
                    if r and r["status"] not in ("passed", "skipped")]
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)
        skipped = [r for r in per_rank if r and r["status"] == "skipped"]
        if skipped and len(skipped) == len(per_rank):
            pytest.skip(skipped[0]["message"])
        if skipped:
            pytest.fail("only some ranks skipped: " + "; ".join(
                f"rank {rank}: {r['status']}" for rank, r in enumerate(per_rank) if r),
                pytrace=False)
        if not all(per_rank):
            missing = [rank for rank, r in enumerate(per_rank) if not r]
            pytest.fail(f"ranks {missing} never finished this test; the job "
                        f"returned {job.returncode}\n--- stdout ---\n"
                        f"{job.stdout[-4000:]}\n--- stderr ---\n{job.stderr[-6000:]}",
                        pytrace=False)

    def _run(self, module, nprocs, options):
        env, timeout, init = options
        tests = [test for test in vars(module).values() if hasattr(test, "mpi_body")
                 and nprocs in test.mpi_rank_counts and any(
                     test_options == options and not _skip_reason(test, variant, nprocs)
                     for variant, test_options in test.mpi_variants.items())]
        names = [label for test in tests for label in test.mpi_labels]
        with tempfile.TemporaryDirectory() as outdir:
            args = ["-m", "tests.mpi_worker", module.__file__, outdir, str(timeout),
                    "1" if init else "0"] + names
            job = run_mpi(nprocs, args, dict(env), timeout * len(names) + 60)
            results = []
            for rank in range(nprocs):
                path = os.path.join(outdir, f"rank{rank}.json")
                results.append(json.load(open(path)) if os.path.exists(path) else {})
        return results, job


def on_a_new_process_set(ranks, body):
    """Inside a job: add a process set of ``ranks``, run body(rank, process_set)
    on its members, and remove the set again on every rank. A body that fails
    leaves the set: removing it is a collective that its peers, still inside
    the body, would never join, and the failure would go unreported."""
    import mpitrain as mt
    process_set = mt.add_process_set(list(ranks))
    if mt.rank() in ranks:
        body(mt.rank(), process_set)
    mt.remove_process_set(process_set)
