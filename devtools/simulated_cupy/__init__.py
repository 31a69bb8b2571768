"""A simulated CUDA device for the tests: the part of CuPy mpitrain uses, on the CPU.

It stands in for ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime``,
``cupy.cuda.nccl`` and ``cupy.cuda.memory`` in ``sys.modules``, so that
mpitrain's own code (mpitrain/backends/arrays.py's one ``import cupy``) runs
unchanged on it. It is stricter than a GPU, never more forgiving:

- device memory is not host memory: numpy refuses its arrays (ndarray.py);
- streams are asynchronous: queued work runs only when something waits for
  it, and in random mode other streams' work runs early, interleaved
  (scheduler.py);
- freed memory is poisoned and handed out again first, or quarantined and
  any later use raises with where it was freed (memory.py);
- kernels run by numpy references pinned to their CUDA source (kernels.py,
  kernel_references.py);
- NCCL runs over MPI on a device thread (nccl.py).

``install()`` switches it on in a process where MPITRAIN_TEST_SIMULATED_GPU
is set (settings.py says the values), before mpitrain first looks for CuPy.
``torch_seam`` lets CPU tensors pass through mpitrain's torch adapter as
simulated device arrays. docs/gpu.md says what it does not model.
"""

import importlib.abc
import importlib.util
import sys
import types

from devtools.simulated_cupy import (functions, kernel_references, kernels, memory, nccl,
                                     runtime, settings, simulation, streams)
from devtools.simulated_cupy.errors import OutOfMemoryError, SimulatedCudaError
from devtools.simulated_cupy.ndarray import ndarray

__all__ = ["install", "installed", "describe", "SimulatedCudaError"]

VERSION = "14.2.0+simulated"

# What of CuPy the stand-in offers, by module: tests/test_gpu_simulation_api.py
# checks each against the installed CuPy.
CUPY = {
    "cupy": {"ndarray": ndarray, "__version__": VERSION, **{
        name: getattr(functions, name) for name in (
            "empty", "empty_like", "zeros", "zeros_like", "ones", "full", "full_like",
            "arange", "asarray", "ascontiguousarray", "asnumpy", "copyto",
            "trunc", "get_default_memory_pool")},
        "RawModule": kernels.RawModule, "RawKernel": kernels.RawKernel},
    "cupy.cuda": {"Device": streams.Device, "Stream": streams.Stream,
                  "Event": streams.Event, "get_current_stream": streams.get_current_stream,
                  "MemoryPointer": memory.MemoryPointer},
    "cupy.cuda.memory": {"OutOfMemoryError": OutOfMemoryError,
                         "MemoryPointer": memory.MemoryPointer},
}


def alloc_pinned_memory(size):
    state = simulation.state()
    return memory.alloc_pinned(state.registry, state.scheduler, size)


CUPY["cupy.cuda"]["alloc_pinned_memory"] = alloc_pinned_memory


def _modules():
    made = {}
    for name, attributes in CUPY.items():
        module = made[name] = types.ModuleType(name, f"simulated {name} (devtools)")
        module.__dict__.update(attributes)
    cupy, cuda = made["cupy"], made["cupy.cuda"]
    cupy.__path__ = cuda.__path__ = []          # packages, whose submodules import
    for dtype in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64",
                  "int64", "float16", "float32", "float64", "bool_", "dtype"):
        setattr(cupy, dtype, getattr(__import__("numpy"), dtype))
    cupy.cuda = cuda
    cuda.runtime, cuda.memory = runtime, made["cupy.cuda.memory"]
    made["cupy.cuda.runtime"] = runtime
    return made


class _NcclImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """cupy.cuda.nccl on import, as CuPy has it: not after a plain ``import cupy``."""

    def find_spec(self, name, path=None, target=None):
        if name == "cupy.cuda.nccl" and installed() is not None:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return nccl

    def exec_module(self, module):
        pass


def installed():
    """The Settings the simulation runs under in this process, or None."""
    return getattr(sys.modules.get("cupy"), "simulated", None)


def describe():
    """What a failing GPU test ran on, for its message."""
    chosen = installed()
    if chosen is None:
        return "a real GPU"
    return f"the simulated GPU ({settings.VARIABLE}={chosen.text})"


def install(chosen=None):
    """Put the simulated CuPy in sys.modules, under ``chosen`` Settings or
    those MPITRAIN_TEST_SIMULATED_GPU gives; None where neither asks for it."""
    chosen = chosen or settings.from_environment()
    if chosen is None or installed() is not None:
        return installed()
    if "cupy" in sys.modules:
        raise RuntimeError("the simulated CUDA device must be installed before "
                           "anything imports cupy")
    simulation.start(chosen)
    from mpitrain.backends.kernels import source
    kernel_references.register_all(source)
    made = _modules()
    made["cupy"].simulated = chosen
    sys.modules.update(made)
    sys.meta_path.insert(0, _NcclImport())
    return chosen
