"""The timeline: Chrome-trace JSON on rank 0, valid even when the job dies."""

import json
import os
import subprocess
import tempfile

import numpy as np
import pytest

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


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB file system of its own, to fill up."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                              str(disk)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_full_disk_ends_the_timeline_with_a_warning_and_training_goes_on(
        small_disk, nprocs):
    path = small_disk / "timeline.json"
    job = run_mpi(nprocs, ["tests/scripts/timeline_steps.py", "200"],
                  env={"MPITRAIN_TIMELINE": str(path)}, timeout=60)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("trained") == nprocs
    assert job.stderr.count("stops here, valid up to its last flush: "
                            "[Errno 28] No space left on device") == 1, job.stderr
    events = json.load(open(path))              # still valid JSON
    assert any(e.get("name") == "MPI_ALLREDUCE" for e in events)


def test_the_timeline_and_autotune_log_do_not_write_through_a_symbolic_link(tmp_path):
    links = {}
    for name in ("timeline.json", "autotune.csv"):
        target = tmp_path / f"precious-{name}"
        target.write_text("precious")
        links[name] = tmp_path / name
        links[name].symlink_to(target)
    job = run_mpi(2, ["tests/scripts/timeline_steps.py", "3"],
                  env={"MPITRAIN_TIMELINE": str(links["timeline.json"]),
                       "MPITRAIN_AUTOTUNE": "1",
                       "MPITRAIN_AUTOTUNE_LOG": str(links["autotune.csv"])}, timeout=60)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("trained") == 2
    for name, link in links.items():
        assert (tmp_path / f"precious-{name}").read_text() == "precious", name
        assert f"{link} is a symbolic link, which mpitrain does not write through" \
            in job.stderr, job.stderr
