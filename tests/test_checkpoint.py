"""Checkpoints: atomic saves, errors on every rank, resuming after a SIGKILL."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import mpitrain.torch as hvd
from mpitrain.checkpoint import write_atomically
from tests.mpi_harness import ROOT, mpi_test, run_mpi

torch.set_num_threads(1)


def run_training(nprocs, directory, steps, result, die_at=None):
    args = ["tests/scripts/resumable_training.py", os.path.join(directory, "ckpt.pt"),
            str(steps), os.path.join(directory, result)]
    return run_mpi(nprocs, args + ([str(die_at)] if die_at is not None else []),
                   timeout=120)


def test_a_job_killed_mid_training_resumes_to_the_same_parameters():
    with tempfile.TemporaryDirectory() as straight, tempfile.TemporaryDirectory() as broken:
        job = run_training(3, straight, 40, "final.pt")
        assert job.returncode == 0, job.stderr[-3000:]
        expected = torch.load(os.path.join(straight, "final.pt"))

        killed = run_training(3, broken, 40, "final.pt", die_at=25)
        assert killed.returncode not in (0, None), killed.stderr[-3000:]
        assert "signal 9" in killed.stderr + killed.stdout
        saved = torch.load(os.path.join(broken, "ckpt.pt"))
        assert saved["extra"] == {"step": 20}
        assert os.listdir(broken) == ["ckpt.pt"]          # nothing half-written

        resumed = run_training(3, broken, 40, "final.pt")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert resumed.stdout.count("starts at step 20") == 3
        got = torch.load(os.path.join(broken, "final.pt"))
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


CRASH_WHILE_WRITING = """
import os, signal, sys
from mpitrain.checkpoint import write_atomically

def write(stream):
    stream.write(b"half of the new checkpoint")
    stream.flush()
    os.kill(os.getpid(), signal.SIGKILL)

write_atomically(sys.argv[1], write)
"""


def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact():
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "ckpt")
        write_atomically(path, lambda stream: stream.write(b"step 10"))
        crash = subprocess.run([sys.executable, "-c", CRASH_WHILE_WRITING, path],
                               cwd=ROOT, capture_output=True, check=False)
        assert crash.returncode == -signal.SIGKILL
        with open(path, "rb") as stream:
            assert stream.read() == b"step 10"

        def fail(stream):
            stream.write(b"partial")
            raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            write_atomically(path, fail)
        with open(path, "rb") as stream:
            assert stream.read() == b"step 10"
        leftovers = [name for name in os.listdir(directory) if name != "ckpt"]
        assert len(leftovers) == 1 and leftovers[0].endswith(".partial")   # the SIGKILL's


@mpi_test()
def test_save_and_load_problems_fail_on_every_rank():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(hvd.CheckpointError, match="saving checkpoint .* failed on rank 0"):
        hvd.save_checkpoint("/nonexistent/dir/ckpt.pt", model)
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    garbage = os.path.join(directory, "garbage.pt")
    if hvd.rank() == 0:
        with open(garbage, "wb") as stream:
            stream.write(b"not a checkpoint")
    with pytest.raises(hvd.CheckpointError, match="loading checkpoint .* failed on rank 0"):
        hvd.load_checkpoint(garbage, model)
    other = torch.nn.Linear(3, 5)            # a checkpoint of another model
    hvd.save_checkpoint(os.path.join(directory, "other.pt"), other)
    with pytest.raises(hvd.CheckpointError, match="size mismatch"):
        hvd.load_checkpoint(os.path.join(directory, "other.pt"), model)
    hvd.barrier()
    if hvd.rank() == 0:
        shutil.rmtree(directory)


@mpi_test()
def test_without_a_checkpoint_every_rank_starts_from_the_roots_state():
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert hvd.load_checkpoint("/nonexistent/ckpt.pt", model, optimizer) is None
    weights = hvd.allgather_object(model.weight.detach().clone())
    assert all(torch.equal(w, weights[0]) for w in weights)
