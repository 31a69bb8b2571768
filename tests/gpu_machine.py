"""Which GPU the GPU tests run on, and the environments of their jobs.

Where CuPy finds a CUDA device, the GPU tests run on it, on the transport the
environment and the MPI library give (shared/gpu/on-device.sh runs them once
per transport: staged, CUDA-aware Open MPI, NCCL), and the one-rank pipeline
on each route. Everywhere else they run on the simulated CUDA device
(devtools/simulated_cupy), under MPITRAIN_TEST_SIMULATED_GPU
(``random:0`` unless it is set), once on each route a device buffer can
take: staged through host memory, CUDA-aware MPI (simulated: MPI reads the
device memory), and NCCL (over MPI), each rank with a GPU of its own.

torch has no CUDA tensors here: under the simulation, torch_device() is the
CPU and mpitrain's torch adapter takes CPU tensors as device arrays
(devtools/simulated_cupy/torch_seam.py); host_reference() computes a
reference on the host meanwhile.
"""

import contextlib
import dataclasses

from devtools import simulated_cupy
from devtools.simulated_cupy import settings as simulated
from mpitrain.backends import arrays

DEFAULT_SIMULATION = "random:0"
STAGED = {"MPITRAIN_GPU_OPERATIONS": "mpi", "MPITRAIN_CUDA_AWARE": "0"}
CUDA_AWARE = {"MPITRAIN_GPU_OPERATIONS": "mpi", "MPITRAIN_CUDA_AWARE": "1"}
NCCL = {"MPITRAIN_GPU_OPERATIONS": "nccl"}
PIPELINE = {"MPITRAIN_TEST_ONE_RANK_PIPELINE": "1"}   # one rank moves its buffers too


def _simulation():
    """The simulated device's Settings, or None where a real GPU is here."""
    chosen = simulated_cupy.installed() or simulated.from_environment()
    if chosen is not None:
        return chosen
    if arrays.cupy() is not None:
        return None
    return simulated.parse(DEFAULT_SIMULATION)


SIMULATION = _simulation()
REAL_GPUS = 0 if SIMULATION is not None else arrays.cupy().cuda.runtime.getDeviceCount()


def job_env(env=None, **options):
    """``env`` for a GPU test's job: under the simulation, with the device it
    simulates (``options`` change its Settings: shared=True, ...)."""
    env = dict(env or {})
    if SIMULATION is not None:
        env[simulated.VARIABLE] = dataclasses.replace(SIMULATION, **options).text
    return env


if SIMULATION is not None:
    ROUTES = {"staged": job_env(STAGED), "cuda-aware": job_env(CUDA_AWARE,
                                                                 cuda_aware_mpi=True),
              "nccl": job_env(NCCL)}
    PIPELINE_ROUTES = ROUTES
else:                  # the transport the environment and the MPI library give
    ROUTES = {"chosen": {}}
    # One GPU takes every route with one rank: NCCL where it loads; MPI,
    # CUDA-aware where the library is; staged.
    PIPELINE_ROUTES = {"chosen": {}, "mpi": {"MPITRAIN_GPU_OPERATIONS": "mpi"},
                       "staged": STAGED}
ONE_RANK_PIPELINES = {route: dict(env, **PIPELINE) for route, env in PIPELINE_ROUTES.items()}


def simulated_in(env):
    """The Settings a job with ``env`` simulates, or None on a real GPU."""
    value = env.get(simulated.VARIABLE)
    return simulated.parse(value) if value else None


def gpus_for(nprocs, env):
    """How many GPUs a job of ``nprocs`` ranks on this machine has between them."""
    settings = simulated_in(env)
    if settings is None:
        return REAL_GPUS
    return 1 if settings.shared else nprocs


def runnable(nprocs, env):
    """Why this machine cannot run a GPU job of ``nprocs`` ranks with ``env``, or None."""
    if env.get("MPITRAIN_GPU_OPERATIONS") == "nccl" and 1 < nprocs and \
            gpus_for(nprocs, env) < nprocs:
        return (f"NCCL needs a GPU for each rank: {nprocs} ranks, "
                f"{gpus_for(nprocs, env)} GPU(s) here (init() refuses such a job, see "
                "test_nccl_on_a_shared_gpu_fails_init)")
    return None


def sharing_a_gpu(nprocs, env):
    """Why a job of ``nprocs`` ranks does not have ranks sharing a GPU here, or None."""
    if gpus_for(nprocs, env) >= nprocs:
        return "every rank has a GPU of its own here"
    return None


# -- torch ---------------------------------------------------------------------------

def torch_device(local_rank):
    """The device a rank's torch tensors go on: its GPU, or under the simulation
    the CPU, whose tensors mpitrain then takes as device arrays."""
    import torch
    if SIMULATION is not None:
        from devtools.simulated_cupy import torch_seam
        torch_seam.enable()
        return torch.device("cpu")
    torch.cuda.set_device(local_rank % REAL_GPUS)
    return torch.device("cuda", torch.cuda.current_device())


def host_reference():
    """A block whose CPU tensors are host tensors, for a reference on the host."""
    if SIMULATION is None:
        return contextlib.nullcontext()
    from devtools.simulated_cupy import torch_seam
    return torch_seam.host_tensors()


def on_gpu(tensor):
    """Is ``tensor`` where torch_device() puts tensors?"""
    if SIMULATION is None:
        return tensor.is_cuda
    from devtools.simulated_cupy import torch_seam
    return tensor.device.type == "cpu" and torch_seam.enabled()


def needs_a_real_gpu(why):
    """Why a test skips under the simulation ("" on a real GPU)."""
    return f"needs a real GPU: {why}" if SIMULATION is not None else ""



def raw_kernel(code, name, reference, scalars):
    """cupy.RawKernel(code, name) for a kernel of one device array and then
    ``scalars`` (numpy types); the simulated device runs it as
    ``reference(array as a numpy view, *scalars)``."""
    if SIMULATION is not None:
        from devtools.simulated_cupy import kernels

        def run(launch):
            reference(launch.array(0), *(launch.scalar(i + 1) for i in range(len(scalars))))
        kernels.register(code, name, (kernels.ARRAY, *scalars), run)
    return arrays.cupy().RawKernel(code, name)
