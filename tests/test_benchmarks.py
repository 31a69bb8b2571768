"""Benchmarks that no CI machine can time still run: the GPU train step, on the CPU."""

import os
import re

from tests.mpi_harness import ROOT, run_mpi


def test_the_gpu_train_step_benchmark_runs_its_three_modes_on_the_cpu():
    job = run_mpi(2, [os.path.join(ROOT, "benchmarks", "train_step_gpu.py"), "--device",
                      "cpu", "--model", "small", "--batch", "4", "--image-size", "32",
                      "--steps", "2", "--warmup", "1", "--rounds", "2"], timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    out = job.stdout
    assert "mpitrain's device transport: none needed (ranks 0, 1 have no CUDA device" in out
    for line in ("    none ", "    ddp ", "    mpitrain ", "  mpitrain / none: ",
                 "  mpitrain / ddp: "):
        assert line in out, out
    difference = re.search(r"mpitrain vs ddp: max \|difference\| = (\S+) ", out)
    assert difference and float(difference.group(1)) < 1e-5, out
