import pytest

from tests.mpi_harness import Jobs


@pytest.fixture(scope="session")
def mpi_jobs():
    return Jobs()
