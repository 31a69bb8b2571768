"""GPU settings that hold on any machine: detection, validation, truthful queries."""

import os

import pytest

import mpitrain as mt
from mpitrain.backends import arrays
from mpitrain.runtime import config
from tests.mpi_harness import mpi_test


def test_gpu_settings_are_validated():
    settings = config.from_environ({"MPITRAIN_CUDA_AWARE": "1",
                                    "HOROVOD_GPU_OPERATIONS": "NCCL"})
    assert settings.cuda_aware == "1" and settings.gpu_operations == "nccl"
    for name, value in (("MPITRAIN_CUDA_AWARE", "yes"),
                        ("MPITRAIN_GPU_OPERATIONS", "gloo")):
        with pytest.raises(ValueError, match=name):
            config.from_environ({name: value})


def test_build_queries_tell_what_this_machine_can_do():
    has_gpu = arrays.cupy() is not None
    assert mt.cuda_built() == has_gpu
    assert (mt.nccl_built() > 0) == (has_gpu and arrays.nccl_version() > 0)


def test_importing_mpitrain_never_needs_cupy():
    import subprocess
    import sys
    code = ("import sys; sys.modules['cupy'] = None; import mpitrain, mpitrain.torch; "
            "print(mpitrain.cuda_built(), mpitrain.nccl_built())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "0"]


@mpi_test(np=(2,), env={"MPITRAIN_CUDA_AWARE": "auto"})
def test_auto_asks_the_mpi_library_whether_it_is_cuda_aware():
    from mpitrain.runtime import topology
    from mpitrain.transport import cuda_aware
    answer = cuda_aware.query(topology.loaded_mpi_library())
    assert mt.api.basics.engine().cuda_aware == bool(answer)


@mpi_test(np=(2,), env={"MPITRAIN_CUDA_AWARE": "1"})
def test_the_user_can_insist_that_mpi_is_cuda_aware():
    assert mt.api.basics.engine().cuda_aware is True


# -- which transport carries device buffers -------------------------------------

def facts(node=0, gpus=("0000:3b:00.0",), nccl=22703, setting="auto", host="a",
          why_no_gpu="", why_no_nccl=""):
    from mpitrain.transport.selection import DeviceFacts
    return DeviceFacts(host, node, gpus, why_no_gpu, nccl, why_no_nccl, False, setting)


def test_auto_takes_nccl_only_where_every_rank_has_a_gpu_of_its_own():
    from mpitrain.transport.selection import choose
    own = [facts(gpus=("0000:3b:00.0",)), facts(gpus=("0000:5e:00.0",))]
    assert choose(own).nccl
    all_visible = [facts(gpus=("0000:3b:00.0", "0000:5e:00.0"))] * 2
    assert choose(all_visible).nccl
    two_hosts = [facts(node=0, host="a"), facts(node=1, host="b")]
    assert choose(two_hosts).nccl
    shared = choose([facts()] * 2)
    assert not shared.nccl
    assert shared.reason == ("ranks 0, 1 share the 1 GPU of host 'a' (0000:3b:00.0), "
                             "and NCCL needs a GPU for each rank")
    no_nccl = choose([facts(), facts(node=1, nccl=0, why_no_nccl="libnccl.so.2 missing")])
    assert not no_nccl.nccl and no_nccl.reason == "rank 1 cannot use NCCL (libnccl.so.2 missing)"
    assert not choose([facts(setting="mpi"), facts(node=1, setting="mpi")]).nccl


def test_nccl_that_cannot_work_is_an_error_that_says_why_and_what_instead():
    from mpitrain.transport.selection import choose
    with pytest.raises(ValueError) as raised:
        choose([facts(setting="nccl")] * 3)
    assert str(raised.value).startswith(
        "MPITRAIN_GPU_OPERATIONS=nccl cannot work here: ranks 0, 1, 2 share the 1 GPU "
        "of host 'a' (0000:3b:00.0), and NCCL needs a GPU for each rank. Use "
        "MPITRAIN_GPU_OPERATIONS=mpi")


def test_check_build_tells_which_transport_jobs_on_this_host_would_use():
    from mpitrain.transport.selection import describe_this_host
    two = describe_this_host(facts(gpus=("0000:3b:00.0", "0000:5e:00.0")))
    assert two[1] == ("  up to 2 ranks on this host: NCCL (every rank has a GPU of its "
                      "own and NCCL 22703 loads)")
    assert two[2].startswith("  3 or more ranks on this host: MPI, staged through pinned "
                             "host memory (ranks 0, 1, 2 share the 2 GPUs of host 'a'")
    forced = describe_this_host(facts(setting="nccl"))
    assert forced[2].startswith("  2 or more ranks on this host: init() fails: "
                                "MPITRAIN_GPU_OPERATIONS=nccl cannot work here")
    none = describe_this_host(facts(gpus=(), why_no_gpu="CuPy is not installed"))
    assert none == ["device transport: none needed, no CUDA device here (CuPy is not "
                    "installed)"]


def no_gpu_here(nprocs, env):
    return "this machine has a CUDA device" if arrays.cupy() is not None else None


@mpi_test(np=(2, 3), init=False, env={"MPITRAIN_GPU_OPERATIONS": "nccl"}, skip=no_gpu_here)
def test_nccl_without_a_gpu_fails_init_on_every_rank():
    with pytest.raises(ValueError) as raised:
        mt.init()
    ranks = ", ".join(str(r) for r in range(int(os.environ["OMPI_COMM_WORLD_SIZE"])))
    assert f"init() failed on ranks {ranks}: MPITRAIN_GPU_OPERATIONS=nccl cannot work " \
           f"here: ranks {ranks} have no CUDA device (" in str(raised.value)
    assert not mt.is_initialized()


@mpi_test(np=(2, 3), init=False, skip=no_gpu_here)
def test_gpu_operations_set_on_one_rank_only_fails_init_on_every_rank():
    if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
        os.environ["MPITRAIN_GPU_OPERATIONS"] = "nccl"
    with pytest.raises(ValueError, match=r"MPITRAIN_GPU_OPERATIONS differs between ranks "
                                         r"\(ranks? 0(, 2)?: auto; rank 1: nccl\)"):
        mt.init()


@mpi_test(np=(2,), skip=no_gpu_here)
def test_by_default_a_job_without_gpus_needs_no_device_transport():
    plan = mt.api.basics.engine().device_plan
    assert not plan.nccl and plan.setting == "auto"
    assert plan.reason.startswith("ranks 0, 1 have no CUDA device (")
