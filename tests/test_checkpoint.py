"""Checkpoints: atomic saves, errors on every rank, resuming after a SIGKILL."""

import contextlib
import io
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

import mpitrain.torch as hvd
from mpitrain.api.checkpoint import read_payload, write_atomically, write_payload
from tests.damage import flip_byte_in_the_middle
from tests.mpi_harness import ROOT, mpi_test, run_mpi

torch.set_num_threads(1)


def read_checkpoint(path):
    return torch.load(io.BytesIO(read_payload(path)), weights_only=True)


@contextlib.contextmanager
def shared_directory():
    """A temporary directory that rank 0 makes and every rank uses."""
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    try:
        yield directory
    finally:
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(directory)


def clone_state(model):
    return {name: value.clone() for name, value in model.state_dict().items()}


def state_equal(model, state):
    got = model.state_dict()
    return got.keys() == state.keys() and all(
        torch.equal(got[name], value) for name, value in state.items())


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
        saved = read_checkpoint(os.path.join(broken, "ckpt.pt"))
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
from mpitrain.api.checkpoint import write_atomically

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
    with shared_directory() as directory:
        garbage = os.path.join(directory, "garbage.pt")
        if hvd.rank() == 0:
            torch.save(model.state_dict(), garbage)       # not through save_checkpoint
        with pytest.raises(hvd.CheckpointError, match="loading checkpoint .* failed on "
                           "rank 0: .* is not an mpitrain checkpoint"):
            hvd.load_checkpoint(garbage, model)
        other = torch.nn.Linear(3, 5)            # a checkpoint of another model
        hvd.save_checkpoint(os.path.join(directory, "other.pt"), other)
        with pytest.raises(hvd.CheckpointError, match="size mismatch"):
            hvd.load_checkpoint(os.path.join(directory, "other.pt"), model)


@mpi_test()
def test_every_rank_may_pass_its_own_path_and_the_roots_counts():
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(3, 2)
    with shared_directory() as directory:
        own = os.path.join(directory, f"ckpt-{hvd.rank()}.pt")     # a timestamp, say
        hvd.save_checkpoint(own, model, step=7)
        assert os.listdir(directory) == ["ckpt-0.pt"]
        resumed = torch.nn.Linear(3, 2)
        assert hvd.load_checkpoint(own, resumed) == {"step": 7}
        roots = hvd.broadcast_object(model.state_dict())
        assert state_equal(resumed, roots)
    with pytest.raises(hvd.CheckpointError,
                       match="saving checkpoint /nonexistent-0/ckpt.pt failed on rank 0"):
        hvd.save_checkpoint(f"/nonexistent-{hvd.rank()}/ckpt.pt", model)


@mpi_test()
def test_extra_values_that_torch_load_would_refuse_are_refused_at_save():
    model = torch.nn.Linear(3, 2)
    with shared_directory() as directory:
        path = os.path.join(directory, "ckpt.pt")
        hvd.save_checkpoint(path, model, step=10)
        for key, value, kind in [("step", np.int64(20), "numpy.int64"),
                                 ("numpy_rng", np.random.get_state(), "tuple")]:
            with pytest.raises(hvd.CheckpointError, match=(
                    f"saving checkpoint .* failed on rank 0: TypeError: extra value "
                    f"'{key}' \\(a {kind}\\) cannot be saved: .*Convert it")):
                hvd.save_checkpoint(path, model, **{key: value})
        assert hvd.load_checkpoint(path, model) == {"step": 10}    # the previous one
        assert os.listdir(directory) == ["ckpt.pt"]


@mpi_test()
def test_a_checkpoint_that_does_not_fit_changes_no_rank():
    torch.manual_seed(hvd.rank())
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    before = clone_state(model)
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    torch.manual_seed(100)
    same = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    wider = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))
    with shared_directory() as directory:
        other_optimizer = os.path.join(directory, "other-optimizer.pt")
        hvd.save_checkpoint(other_optimizer, same,
                            torch.optim.SGD(same[0].parameters(), lr=0.1))
        other_model = os.path.join(directory, "other-model.pt")
        hvd.save_checkpoint(other_model, wider)
        for path, error in [(other_optimizer, "parameter group"),
                            (other_model, "size mismatch")]:
            with pytest.raises(hvd.CheckpointError, match=error):
                hvd.load_checkpoint(path, model, optimizer)
            unchanged = state_equal(model, before) and all(
                torch.equal(optimizer.state[p]["momentum_buffer"], buffer)
                for p, buffer in zip(model.parameters(), momentum))
            everyone = hvd.allgather_object(unchanged)     # so no rank fails alone
            assert all(everyone), f"unchanged, by rank: {everyone}"


@mpi_test()
def test_a_damaged_checkpoint_is_refused_on_every_rank():
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(100, 100)           # the middle of the file is weights
    before = clone_state(model)
    with shared_directory() as directory:
        path = os.path.join(directory, "ckpt.pt")
        hvd.save_checkpoint(path, torch.nn.Linear(100, 100), step=1)
        if hvd.rank() == 0:
            flip_byte_in_the_middle(path)
        with pytest.raises(hvd.CheckpointError,
                           match=f"{re.escape(path)} is corrupt: its SHA-256"):
            hvd.load_checkpoint(path, model)
    assert state_equal(model, before)


@mpi_test()
def test_a_checkpoint_keeps_the_mode_of_the_file_it_replaces():
    model = torch.nn.Linear(3, 2)
    with shared_directory() as directory:
        path = os.path.join(directory, "ckpt.pt")
        umask = os.umask(0o027)
        try:
            hvd.save_checkpoint(path, model)
        finally:
            os.umask(umask)
        new = stat.S_IMODE(os.stat(path).st_mode)
        hvd.barrier()                            # every rank has looked
        if hvd.rank() == 0:
            os.chmod(path, 0o604)
        hvd.save_checkpoint(path, model)
        modes = (new, stat.S_IMODE(os.stat(path).st_mode))
        assert modes == (0o640, 0o604), [oct(mode) for mode in modes]


@mpi_test()
def test_without_a_checkpoint_every_rank_starts_from_the_roots_state():
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert hvd.load_checkpoint("/nonexistent/ckpt.pt", model, optimizer) is None
    weights = hvd.allgather_object(model.weight.detach().clone())
    assert all(torch.equal(w, weights[0]) for w in weights)


class RunsCode:
    """A pickle that creates a file when it is unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@mpi_test()
def test_a_checkpoint_that_would_run_code_when_unpickled_is_refused_and_runs_nothing():
    """docs/security.md: checkpoint files are data. A file with a valid
    checksum (anyone who can write the file can compute one) whose pickle
    calls a function is refused on every rank, and the function never runs."""
    model = torch.nn.Linear(2, 2)
    before = clone_state(model)
    with shared_directory() as directory:
        path, marker = os.path.join(directory, "ckpt.pt"), os.path.join(directory, "ran")
        if hvd.rank() == 0:
            payload = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": None,
                        "extra": {"step": RunsCode(marker)}}, payload)
            write_payload(path, payload.getvalue())
        with pytest.raises(hvd.CheckpointError, match="Weights only load failed"):
            hvd.load_checkpoint(path, model)
        assert not os.path.exists(marker)
    assert state_equal(model, before)
