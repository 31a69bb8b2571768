"""Tools the tests and the benchmarks share, kept out of the installed package.

``mpi_jobs``: the mpirun command for this machine, the environment a job
needs, and killing a job with every rank it started; ``hosts``: several
"hosts" on this one machine as Linux network namespaces, and running a job
across them. The tests' harness (tests/mpi_harness.py) and the benchmarks
that launch their own jobs both build on these.
"""
