"""PyTorch's own distributed tests, pointed at the "mpitrain" backend.

torch ships its backend-neutral suite with the wheel
(torch/testing/_internal/distributed/distributed_test.py, the tests of
test/distributed/test_distributed_spawn.py: BACKEND names the backend). torch
runs each test in processes it spawns; here each runs on the ranks of an
mpirun job, as TestDistBackend._run does in each process: a fresh default
group of BACKEND "mpitrain" (no address, rank or size given), the test
method, a barrier, the group destroyed.

The suite runs SUITE, the tests that pass and take a few seconds at most;
``python tests/test_torch_distributed_torch_suite.py [--np 3] [NAME ...]``
runs every test of torch's list (or those named) in mpirun jobs, a failed or
hung test ending its job and the next job starting after it, and prints each
test's outcome (docs/torch-distributed.md lists the last run's).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback
import unittest

import pytest

from tests.mpi_harness import mpi_test, run_mpi

# torch's own tests that pass here in a few seconds each; their names say what
# they cover. (Its *_group tests skip below 8 ranks.)
SUITE = (
    "test_get_rank", "test_get_backend", "test_get_rank_size_group",
    "test_get_rank_size_full_group", "test_destroy_group", "test_destroy_full_group",
    "test_broadcast", "test_broadcast_full_group", "test_reduce_sum",
    "test_reduce_product", "test_reduce_min", "test_reduce_max",
    "test_reduce_full_group_max", "test_reduce_sum_twice", "test_all_reduce_sum",
    "test_all_reduce_sum_async", "test_all_reduce_product", "test_all_reduce_min",
    "test_all_reduce_max", "test_all_reduce_full_group_product",
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_full_group_max", "test_scatter", "test_scatter_full_group",
    "test_gather", "test_gather_full_group", "test_all_gather", "test_all_gather_full_group",
    "test_all_gather_coalesced_simple", "test_all_to_all_single_equal_split",
    "test_all_to_all_single_unequal_split", "test_all_to_all", "test_all_to_all_full_group",
    "test_barrier", "test_barrier_full_group", "test_send_recv", "test_send_recv_with_tag",
    "test_isend", "test_irecv", "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view", "test_get_future",
    "test_all_gather_object_default_pg", "test_all_gather_object_subgroup",
    "test_gather_object", "test_scatter_object_list",
)


def _prepare_environment(temp_dir, world_size):
    os.environ.update(BACKEND="mpitrain", WORLD_SIZE=str(world_size), TEMP_DIR=temp_dir)


def _last_line(report):
    """The exception's own line of a traceback (torch's tests add a repro hint)."""
    lines = [line for line in report.strip().splitlines()
             if line and not line.startswith(" ") and "PYTORCH_PRINT_REPRO" not in line
             and not line.startswith("Traceback")]
    return lines[-1] if lines else report.strip()[-300:]


def _skip_reasons():
    from torch.testing._internal.common_distributed import TEST_SKIPS
    return {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


def run_in_job(names, temp_dir, results_path, stop_at_failure):
    """Run torch's tests ``names`` on this rank; rank 0 appends each outcome to
    ``results_path``. Returns the outcomes."""
    import mpitrain.torch as hvd
    hvd.init()
    _prepare_environment(temp_dir, hvd.size())
    if hvd.rank() == 0:          # torch's initialize_temp_directories, in temp_dir
        for folder in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(temp_dir, folder), exist_ok=True)
    hvd.barrier()
    import torch.distributed as dist
    from torch.testing._internal.common_utils import SEED, set_rng_seed
    from torch.testing._internal.distributed.distributed_test import (
        Barrier, DistributedTest, TestDistBackend)

    class MpitrainBackendTest(TestDistBackend, DistributedTest._DistTestBase):
        pass

    if hvd.rank() == 0:
        Barrier.init()
    hvd.barrier()
    outcomes = {}
    for name in names:
        test = MpitrainBackendTest(name)
        test.rank = hvd.rank()
        outcome = "passed"
        set_rng_seed(SEED)                   # as torch's TestCase.setUp does
        try:
            dist.init_process_group("mpitrain")
            test._barrier()
            getattr(test, name)()
            test._barrier()
        except unittest.SkipTest as skip:
            outcome = f"skipped: {skip}"
        except SystemExit as exit:           # torch's decorators skip by exit codes
            outcome = f"skipped: {_skip_reasons().get(exit.code, exit.code)}"
        except Exception:
            outcome = "failed: " + _last_line(traceback.format_exc())
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        everyone = hvd.allgather_object(outcome, name=f"outcome of {name}")
        outcome = next((o for o in everyone if o.startswith("failed")), everyone[0])
        outcomes[name] = outcome
        if hvd.rank() == 0:
            with open(results_path, "a") as stream:
                stream.write(json.dumps({"test": name, "outcome": outcome}) + "\n")
        if stop_at_failure and outcome.startswith("failed"):
            break
    return outcomes


@mpi_test(np=(3,), timeout=240)
def test_torchs_own_distributed_tests_pass_on_the_mpitrain_backend():
    pytest.importorskip("expecttest")     # torch.testing._internal imports it
    import mpitrain.torch as hvd
    hvd.init()
    temp_dir = [tempfile.mkdtemp(prefix="mpitrain-torch-suite-") if hvd.rank() == 0 else None]
    temp_dir = hvd.broadcast_object(temp_dir)[0]
    try:
        outcomes = run_in_job(SUITE, temp_dir, os.path.join(temp_dir, "results.jsonl"), False)
    finally:
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(temp_dir, ignore_errors=True)
    bad = {name: outcome for name, outcome in outcomes.items() if outcome != "passed"}
    assert not bad, bad


def _job_main(arguments):
    names = arguments[2].split(",")
    run_in_job(names, arguments[0], arguments[1], stop_at_failure=True)


def _sweep():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per job")
    parser.add_argument("names", nargs="*", help="torch's test names (default: all)")
    args = parser.parse_args()
    # what torch's test module reads when it is imported, for the list of names
    _prepare_environment(tempfile.gettempdir(), args.np)
    from torch.testing._internal.distributed.distributed_test import DistributedTest
    names = args.names or sorted(n for n in dir(DistributedTest._DistTestBase)
                                 if n.startswith("test_"))
    temp_dir = tempfile.mkdtemp(prefix="mpitrain-torch-suite-")
    results_path = os.path.join(temp_dir, "results.jsonl")
    outcomes = {}
    while len(outcomes) < len(names):
        left = [n for n in names if n not in outcomes]
        job = run_mpi(args.np, [os.path.abspath(__file__), "--job", temp_dir, results_path,
                                ",".join(left)],
                      env={"MPITRAIN_STALL_CHECK_TIME_SECONDS": "10",
                           "MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS": "30"},
                      timeout=args.timeout)
        if os.path.exists(results_path):
            with open(results_path) as stream:
                for line in stream:
                    record = json.loads(line)
                    outcomes[record["test"]] = record["outcome"]
        if job.returncode != 0 and len(outcomes) < len(names):
            stuck = next(n for n in names if n not in outcomes)
            outcomes[stuck] = ("hung" if job.returncode is None else
                               f"failed: the job ended ({job.returncode})")
            with open(results_path, "a") as stream:
                stream.write(json.dumps({"test": stuck, "outcome": outcomes[stuck]}) + "\n")
    shutil.rmtree(temp_dir, ignore_errors=True)
    for name in names:
        print(f"{name}: {outcomes[name]}")
    counts = {}
    for outcome in outcomes.values():
        key = outcome.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    print(counts)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        _job_main(sys.argv[2:])
    else:
        _sweep()
