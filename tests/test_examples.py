"""The examples run as their docstrings say, through mpitrainrun, and reach
what the README promises: digits at 0.9 or better on 2 ranks in under two
minutes, throughput per rank and in total from the benchmarks."""

import os
import re
import subprocess
import sys
import time

import pytest

from tests.mpi_harness import ROOT, job_environment

LAUNCHER = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
TWO_MINUTES = 120


def launch_example(nprocs, script, *args, timeout=TWO_MINUTES):
    """(the finished job, seconds) of `mpitrainrun -np N python examples/<script>`;
    its output as bytes, carriage returns kept."""
    started = time.monotonic()
    job = subprocess.run([LAUNCHER, "-np", str(nprocs), sys.executable,
                          os.path.join("examples", script), *args],
                         cwd=ROOT, env=job_environment(), capture_output=True,
                         timeout=timeout)
    seconds = time.monotonic() - started
    assert job.returncode == 0, job.stderr[-4000:].decode(errors="replace")
    return job, seconds


def run_example(nprocs, script, *args, timeout=TWO_MINUTES):
    """(stdout without the rank tags, seconds) of launch_example()."""
    job, seconds = launch_example(nprocs, script, *args, timeout=timeout)
    return untagged_stdout(job), seconds


def untagged_stdout(job):
    # mpitrainrun tags every line with its rank: "[1,0]<stdout>: ..."
    return re.sub(r"^\[1,\d+\]<stdout>: ", "", job.stdout.decode(), flags=re.M)


def progress_bar_pieces(job):
    """The pieces of the ranks' progress-bar lines on stderr that show
    something, as tagged."""
    return [piece for line in job.stderr.decode().split("\n") if "epoch" in line
            for piece in line.split("\r")
            if re.sub(r"^\[1,\d+\]<stderr>: ", "", piece).strip()]


def assert_one_bar_on_rank_0(job, epochs):
    pieces = progress_bar_pieces(job)
    assert pieces and all(piece.startswith("[1,0]<stderr>: ") for piece in pieces), pieces
    assert pieces[0].startswith("[1,0]<stderr>:   0%|"), pieces      # no empty bar first
    assert f"| {epochs}/{epochs} [" in pieces[-1], pieces


def final_accuracy(stdout):
    lines = stdout.strip().splitlines()
    match = re.fullmatch(r"test accuracy: (\d\.\d\d)", lines[-1])
    assert match, stdout[-2000:]
    assert stdout.count("test accuracy:") == 1          # printed by rank 0 only
    return float(match.group(1))


@pytest.mark.parametrize("nprocs", [2, 3])
def test_pytorch_digits(nprocs):
    job, seconds = launch_example(nprocs, "pytorch_digits.py")
    assert final_accuracy(untagged_stdout(job)) >= 0.9
    assert seconds < TWO_MINUTES
    assert_one_bar_on_rank_0(job, 15)


def test_pytorch_sharded_digits(tmp_path):
    checkpoint = str(tmp_path / "digits.pt")
    stdout, seconds = run_example(2, "pytorch_sharded_digits.py", "--checkpoint", checkpoint)
    assert final_accuracy(stdout) >= 0.9
    shares = re.search(r"Adam state per rank: (\d+), (\d+) bytes \(of (\d+)\)", stdout)
    assert shares, stdout[-2000:]
    first, second, total = map(int, shares.groups())
    assert 0 < first < total and 0 < second < total     # each rank holds a part only
    assert os.path.exists(checkpoint)
    assert seconds < TWO_MINUTES


def test_pytorch_local_sgd_digits_sends_a_third_of_the_bytes():
    stdout, seconds = run_example(2, "pytorch_local_sgd_digits.py")
    assert final_accuracy(stdout) >= 0.9
    steps = re.search(r"^(\d+) steps: (\d+) synchronous, (\d+) local with (\d+) averages "
                      r"of the parameters$", stdout, re.M)
    sent = re.search(r"^bytes sent per rank: (\d+) against (\d+) averaging the gradients "
                     r"every step \(([\d.]+) of it\)$", stdout, re.M)
    assert steps and sent, stdout[-2000:]
    total, synchronous, local, averages = map(int, steps.groups())
    assert synchronous + local == total and total == 15 * synchronous    # one warm-up epoch
    assert averages == local // 4 + 1              # every 4 steps, and once at the end
    model_bytes = 4 * 38282                 # pytorch_digits.network()'s float32 parameters
    assert int(sent.group(2)) == total * model_bytes
    assert int(sent.group(1)) == (synchronous + averages) * model_bytes
    assert float(sent.group(3)) == pytest.approx((synchronous + averages) / total, abs=1e-3)
    assert seconds < TWO_MINUTES


def test_pytorch_amp_digits_in_bfloat16_and_the_float16_grad_scaler_recipe():
    stdout, seconds = run_example(2, "pytorch_amp_digits.py")
    assert final_accuracy(stdout) >= 0.9
    assert seconds < TWO_MINUTES
    # float16 is slow on the CPU: one epoch of few batches runs the recipe.
    stdout, _ = run_example(2, "pytorch_amp_digits.py", "--dtype", "float16",
                            "--epochs", "1", "--batch-size", "128")
    final_accuracy(stdout)


def test_keras_digits():
    job, seconds = launch_example(2, "keras_digits.py")
    assert final_accuracy(untagged_stdout(job)) >= 0.9
    assert seconds < TWO_MINUTES
    assert_one_bar_on_rank_0(job, 15)


def test_keras_mixed_precision_digits_runs_its_recipe():
    # float16 is slow on the CPU (15 epochs reach 0.98 in minutes here): a
    # few batches show that the LossScaleOptimizer inside DistributedOptimizer runs.
    stdout, _ = run_example(2, "keras_mixed_precision_digits.py", "--epochs", "1",
                            "--batch-size", "128")
    assert float(re.search(r"^loss scale: (\S+)$", stdout, re.M).group(1)) > 0
    final_accuracy(stdout)


def test_a_horovod_script_runs_with_only_its_import_changed():
    source = open(os.path.join(ROOT, "examples", "pytorch_horovod_script.py")).read()
    assert "import horovod" not in source.replace("# was: import horovod", "")
    stdout, _ = run_example(2, "pytorch_horovod_script.py", "--epochs", "6",
                            "--fp16-allreduce")
    accuracy = re.findall(r"test accuracy ([\d.]+)%", stdout)
    assert len(accuracy) == 6 and float(accuracy[-1]) > 80, stdout[-2000:]


def throughput(stdout, nprocs):
    per_rank = float(re.search(r"^images/sec per rank: ([\d.]+) \+-[\d.]+$",
                               stdout, re.M).group(1))
    total = float(re.search(rf"^total images/sec on {nprocs} ranks: ([\d.]+) \+-[\d.]+$",
                            stdout, re.M).group(1))
    return per_rank, total


@pytest.mark.parametrize("script,model", [
    ("pytorch_synthetic_benchmark.py", "resnet18"),
    ("tensorflow2_synthetic_benchmark.py", "MobileNetV2"),
])
def test_synthetic_benchmarks_report_per_rank_and_total(script, model):
    stdout, _ = run_example(2, script, "--model", model, "--image-size", "32",
                            "--batch-size", "2", "--num-warmup-batches", "1",
                            "--num-batches-per-iter", "1", "--num-iters", "2")
    assert len(re.findall(r"^iteration \d: [\d.]+ images/sec per rank$",
                          stdout, re.M)) == 2
    per_rank, total = throughput(stdout, 2)
    assert per_rank > 0 and abs(total - 2 * per_rank) <= 0.2
