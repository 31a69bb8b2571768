"""GPU settings that hold on any machine: detection, validation, truthful queries."""

import pytest

import mpitrain as mt
from mpitrain import arrays, config
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
    from mpitrain import cuda_aware
    answer = cuda_aware.query(cuda_aware.loaded_mpi_library())
    assert mt.basics.engine().cuda_aware == bool(answer)


@mpi_test(np=(2,), env={"MPITRAIN_CUDA_AWARE": "1"})
def test_the_user_can_insist_that_mpi_is_cuda_aware():
    assert mt.basics.engine().cuda_aware is True
