"""mpitrain under a real Slurm: Debian's slurm-wlm, started for this one
machine from a scratch folder (devtools/slurm.py), runs sbatch jobs of 2
tasks that train the digits example: mpitrainrun inside the allocation
(no -H), srun --mpi=pmix, and plain srun, which must stop at init() on every
task with the fix instead of training twice alone. Slurm's node lists
expand as `scontrol show hostnames` expands them. Without Slurm (install it
with devtools/install-slurm.sh) or root, the Slurm tests skip and say why."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from devtools.slurm import SlurmUnavailable, one_machine_slurm
from mpitrain.launcher import run, slurm as allocation
from mpitrain.runtime.slurm_step import lone_task_problem
from tests.mpi_harness import job_environment

BIN = os.path.dirname(sys.executable)
DIGITS = f"{sys.executable} examples/pytorch_digits.py"


@pytest.fixture(scope="module")
def slurm():
    try:
        with one_machine_slurm() as running:
            yield running
    except SlurmUnavailable as reason:
        pytest.skip(str(reason))


def batch(slurm, body):
    """Run ``body`` as an sbatch job of 2 tasks; (exit code, its output)."""
    return slurm.batch(body, tasks=2, timeout=240, env=job_environment())


def accuracy(output):
    """The one accuracy rank 0 prints; two would be two jobs of one rank."""
    accuracies = re.findall(r"test accuracy: (\d\.\d\d)$", output, flags=re.M)
    assert len(accuracies) == 1, output[-3000:]
    return float(accuracies[0])


@pytest.fixture(scope="module")
def mpitrainrun_job(slurm):
    return batch(slurm, f"{BIN}/mpitrainrun -np 2 --dry-run {DIGITS}\n"
                        f"{BIN}/mpitrainrun -np 3 --dry-run {DIGITS}; echo exit $?\n"
                        f"{BIN}/mpitrainrun -np 2 {DIGITS}")


NODE_LISTS = ["gpu[01-04,07]", "gpu[01-04,07],login1", "n[8-10]", "n[098-100],m1",
              "rack[1-2]n[01-02]", "x[1]", "cn[1-3,5-6],gpu[1]", "node1,node2"]


@pytest.mark.parametrize("node_list", NODE_LISTS)
def test_a_node_list_expands_as_scontrol_expands_it(node_list, tmp_path):
    if shutil.which("scontrol") is None:
        pytest.skip("Slurm is not installed (devtools/install-slurm.sh installs it)")
    # scontrol expands a list without a Slurm running, but wants a configuration.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=expand\nSlurmctldHost=localhost\n")
    expected = subprocess.run(["scontrol", "show", "hostnames", node_list],
                              env={**os.environ, "SLURM_CONF": str(conf)},
                              capture_output=True, text=True, check=True).stdout.split()
    assert allocation.expand_node_list(node_list) == expected


def test_task_counts_repeat_as_slurm_writes_them():
    # sbatch's manual: SLURM_TASKS_PER_NODE=2(x3),1 is 2 tasks on each of the
    # first three nodes and 1 on the fourth.
    assert allocation.expand_task_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match=r"'2x3' is not N or N\(xM\)"):
        allocation.expand_task_counts("2x3")


def test_a_dry_run_in_an_allocation_shows_each_ranks_node(capsys):
    environ = job_environment({"SLURM_JOB_NODELIST": "gpu[01-02],cpu7",
                               "SLURM_TASKS_PER_NODE": "2(x2),4"})
    assert run.main(["--dry-run", "-np", "7", "python", "train.py"], environ) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:3] == ["# ranks 0-1 on gpu01", "# ranks 2-3 on gpu02",
                                    "# ranks 4-6 on cpu7"]
    assert "--host gpu01:2,gpu02:2,cpu7:4 " in out


def test_srun_tasks_that_mpi_sees_alone_are_refused_and_mpiruns_ranks_are_not():
    step = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}
    assert "mpitrainrun -np 4" in lone_task_problem(1, step)
    assert lone_task_problem(4, step) == ""                     # srun --mpi=pmix
    assert lone_task_problem(1, {**step, "OMPI_COMM_WORLD_SIZE": "1"}) == ""
    # The batch script itself is one process, whatever the job's task count.
    assert lone_task_problem(1, {"SLURM_NTASKS": "4"}) == ""


def test_mpitrainrun_in_an_allocation_trains_on_its_slots(slurm, mpitrainrun_job):
    code, output = mpitrainrun_job
    assert code == 0, output[-3000:]
    assert f"# ranks 0-1 on {slurm.node}\n" in output
    assert f" --host {slurm.node}:2 " in output
    assert re.search(r"-np 3 needs 3 slots but the Slurm allocation \(SLURM_JOB_NODELIST="
                     rf"{slurm.node}, SLURM_TASKS_PER_NODE=2\) gives 2.*\nexit 2\n", output)
    assert accuracy(output) >= 0.9


def test_srun_with_pmix_trains_as_mpitrainrun_does(slurm, mpitrainrun_job):
    plugins = subprocess.run(["srun", "--mpi=list"], env=slurm.environment(),
                             capture_output=True, text=True)
    if "pmix" not in plugins.stdout + plugins.stderr:
        pytest.skip(f"this Slurm has no PMIx plugin: {plugins.stdout + plugins.stderr}")
    code, output = batch(slurm, f"srun --mpi=pmix {DIGITS}")
    assert code == 0, output[-3000:]
    # The same 2 ranks, shards and seeds: the same accuracy.
    assert accuracy(output) == accuracy(mpitrainrun_job[1])


def test_plain_srun_stops_every_task_at_init_with_the_fix(slurm):
    code, output = batch(slurm, f"srun {DIGITS}")
    assert code != 0
    refusals = re.findall(r"^RuntimeError: (.*)$", output, flags=re.M)
    assert refusals == [
        "srun started 2 tasks (SLURM_STEP_NUM_TASKS=2) but MPI sees each as a job of 1 "
        "rank, so each would train alone: srun gave MPI no PMIx. Run `srun --mpi=pmix "
        "...` (`srun --mpi=list` shows whether this Slurm has it), or `mpitrainrun -np 2 "
        "...` inside the allocation instead of srun"] * 2, output[-3000:]
    assert "test accuracy" not in output
