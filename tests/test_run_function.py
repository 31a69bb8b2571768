"""mpitrain.run, Horovod's horovod.run: a function (a closure, given a
lambda) runs on every rank, its return values come back in rank order, and a
rank that raises makes the caller raise with that rank's traceback. Each
caller is a script of its own, started with a timeout, so a hang fails."""

import json
import subprocess
import sys

import pytest

import mpitrain
from tests.mpi_harness import ROOT, job_environment

RESULTS = """
import json, sys
import mpitrain

def make_work(offset):
    def work(transform, scale=1):
        import numpy as np
        import mpitrain as mt
        mt.init()
        total = mt.allreduce(np.array([mt.rank()], np.float64), op=mt.Sum)
        return {"rank": mt.rank(), "size": mt.size(),
                "total": float(total[0]) * scale + offset,
                "transformed": transform(mt.rank())}
    return work

results = mpitrain.run(make_work(100), args=(lambda rank: rank * 10,),
                       kwargs={"scale": 2}, np=int(sys.argv[1]))
print(json.dumps(results))
"""

RANK_ONE_RAISES = """
import mpitrain

def train():
    import mpitrain as mt
    mt.init()
    if mt.rank() == 1:
        raise ValueError("rank 1: the batch is corrupt")
    mt.barrier()          # rank 0 waits for rank 1, which never comes
    return "done"

try:
    mpitrain.run(train, np=2)
except mpitrain.launcher.function.RankError as error:
    print("RANK", error.rank)
    print("TRACEBACK", error.remote_traceback)
"""


def caller(tmp_path, script, *args):
    path = tmp_path / "caller.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path), *map(str, args)], cwd=ROOT,
                          env=job_environment(), capture_output=True, text=True,
                          timeout=150)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_results_come_back_in_rank_order_with_the_args_and_kwargs(nprocs, tmp_path):
    job = caller(tmp_path, RESULTS, nprocs)
    assert job.returncode == 0, job.stderr
    results = json.loads(job.stdout.splitlines()[-1])
    total = sum(range(nprocs)) * 2 + 100
    assert results == [{"rank": rank, "size": nprocs, "total": total,
                        "transformed": rank * 10} for rank in range(nprocs)]


def test_a_rank_that_raises_raises_in_the_caller_with_its_rank_and_traceback(tmp_path):
    job = caller(tmp_path, RANK_ONE_RAISES)
    assert job.returncode == 0, job.stderr
    assert "RANK 1\n" in job.stdout, job.stdout + job.stderr
    traceback = job.stdout.split("TRACEBACK ", 1)[1]
    assert traceback.startswith("Traceback (most recent call last):\n  File "), traceback
    assert 'in train\n    raise ValueError("rank 1: the batch is corrupt")' in traceback
    assert "mpitrain/launcher/function.py" not in traceback
    assert traceback.rstrip().endswith("ValueError: rank 1: the batch is corrupt")


@pytest.mark.parametrize("argument", ["ssh_port", "ssh_identity_file", "output_filename"])
def test_horovods_ssh_and_output_arguments_are_refused_with_what_to_do(argument):
    with pytest.raises(ValueError, match=f"mpitrain.run: {argument}=2 is not supported: "
                                         "give it to Open MPI through mpi_args"):
        mpitrain.run(print, np=2, **{argument: 2})


@pytest.mark.parametrize("arguments, error", [
    ({"min_num_proc": 2}, "--min-np needs the hosts to choose from"),
    ({"reset_limit": 2}, "--reset-limit is for elastic jobs"),
    ({"host_discovery_script": "./hosts.sh", "max_num_proc": 1},
     "--max-np 1 is less than -np 2"),
    ({"host_discovery_script": "./hosts.sh", "cooldown_range": (5, 1)},
     "--blacklist-cooldown-range 5 1: give MIN <= MAX"),
])
def test_elastic_arguments_that_do_not_fit_are_refused_before_anything_starts(
        arguments, error):
    with pytest.raises(ValueError, match=f"mpitrain.run: .*{error}"):
        mpitrain.run(print, num_proc=2, **arguments)


ELASTIC = """
import json, os, signal, sys
import mpitrain

def train():
    import torch
    import mpitrain.torch as hvd
    hvd.init()
    state = hvd.elastic.TorchState(step=0)

    @hvd.elastic.run
    def steps(state):
        while state.step < 6:
            if state.step == 4 and state.restarts == 0 and hvd.rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            hvd.allreduce(torch.ones(1), name="step")     # rank 0 waits here for rank 1
            state.step += 1
            state.commit()

    steps(state)
    return hvd.rank(), hvd.size(), state.restarts, state.step

print(json.dumps(mpitrain.run(train, num_proc=2, host_discovery_script=sys.argv[1],
                              min_num_proc=2, cooldown_range=[1, 1])))
"""


def test_an_elastic_run_returns_the_results_of_the_job_after_its_restart(tmp_path):
    # One host of two slots: the lost rank's host comes back after a second.
    hosts = tmp_path / "hosts.sh"
    hosts.write_text("#!/bin/sh\necho localhost:2\n")
    hosts.chmod(0o755)
    job = caller(tmp_path, ELASTIC, hosts)
    assert job.returncode == 0, job.stderr
    assert "rank 1 on localhost was lost" in job.stderr
    assert "resumed from commit 4 (step=4)" in job.stderr
    assert json.loads(job.stdout.splitlines()[-1]) == [[0, 2, 1, 6], [1, 2, 1, 6]]


def test_the_rank_count_must_be_a_whole_number_of_ranks():
    with pytest.raises(ValueError, match="num_proc must be a whole number >= 1, not 0"):
        mpitrain.run(print, num_proc=0)
    with pytest.warns(DeprecationWarning, match="np is deprecated, use num_proc"), \
            pytest.raises(ValueError, match="np must be a whole number >= 1, not 0"):
        mpitrain.run(print, np=0)
