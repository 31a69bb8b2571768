"""init, topology queries, build queries, shutdown."""

import subprocess
import sys

import pytest

import mpitrain as mt
from tests.mpi_harness import mpi_test


def test_queries_before_init_say_to_call_init():
    for query in (mt.rank, mt.size, mt.local_rank, mt.local_size, mt.cross_rank,
                  mt.cross_size, mt.is_homogeneous, mt.mpi_threads_supported,
                  mt.mpi_enabled):
        with pytest.raises(ValueError, match=r"init\(\)"):
            query()
    assert not mt.is_initialized()
    with pytest.raises(ValueError, match=r"init\(\)"):
        mt.allreduce([1.0])


def test_importing_the_frameworks_modules_leaves_mpi_alone():
    """MPI starts in init(), with the thread level mpitrain needs; importing
    mpi4py.MPI earlier would start it at import, and a job with a rank that
    exits before init() would then hang in MPI's start instead of failing."""
    for module in ("mpitrain", "mpitrain.torch"):
        code = f"import sys, {module}; print('mpi4py.MPI' in sys.modules)"
        said = subprocess.run([sys.executable, "-c", code], capture_output=True,
                              text=True, timeout=120)
        assert said.stdout.strip() == "False", (module, said.stdout, said.stderr[-2000:])


def test_build_queries_answer_without_init():
    assert mt.mpi_built() is True
    assert not any([mt.gloo_built(), mt.nccl_built(), mt.ddl_built(), mt.ccl_built(),
                    mt.cuda_built(), mt.rocm_built()])


@mpi_test()
def test_topology_of_a_single_machine():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    assert (mt.rank(), mt.size()) == (world.rank, world.size)
    assert (mt.local_rank(), mt.local_size()) == (world.rank, world.size)
    assert (mt.cross_rank(), mt.cross_size()) == (0, 1)
    assert mt.is_homogeneous() and mt.mpi_threads_supported() and mt.mpi_enabled()
    assert mt.is_initialized()


@mpi_test()
def test_init_twice_is_harmless():
    engine = mt.api.basics.engine()
    mt.init()
    assert mt.api.basics.engine() is engine
    assert mt.allreduce([1.0], op=mt.Sum)[0] == mt.size()


@mpi_test(init=False)
def test_init_on_a_list_of_ranks_and_shutdown_then_reinit():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.rank < 2:
        mt.init(comm=[0, 1])
        assert mt.size() == 2 and mt.rank() == world.rank
        assert mt.allreduce([1.0], op=mt.Sum)[0] == 2
        mt.shutdown()
    world.Barrier()
    mt.init(comm=world)
    assert mt.size() == world.size
    mt.shutdown()
    assert not mt.is_initialized()
    with pytest.raises(ValueError, match=r"init\(\)"):
        mt.rank()
    mt.init()
    assert mt.allreduce([2.0], op=mt.Sum)[0] == 2 * world.size
