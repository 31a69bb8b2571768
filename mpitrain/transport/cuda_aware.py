"""Can the MPI library in this process read and write CUDA device memory?

``auto`` asks the library itself through ctypes (Open MPI's
MPIX_Query_cuda_support, MPICH's MPIX_GPU_query_support). It never tries a
device pointer: a library that is not CUDA-aware crashes on one.
"""

import ctypes
import logging

from mpitrain.runtime import topology

log = logging.getLogger("mpitrain")

_MPIX_GPU_SUPPORT_CUDA = 0     # the first value of MPICH's MPIX_GPU_SUPPORT_* enum


def query(path):
    """True or False as the library answers, or None when it has no such query."""
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return None
    open_mpi = getattr(library, "MPIX_Query_cuda_support", None)
    if open_mpi is not None:
        open_mpi.restype = ctypes.c_int
        return bool(open_mpi())
    mpich = getattr(library, "MPIX_GPU_query_support", None)
    if mpich is not None:
        flag = ctypes.c_int(0)
        mpich.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        if mpich(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
            return bool(flag.value)
    return None


def resolve(setting):
    """MPITRAIN_CUDA_AWARE (auto, 1 or 0) as True or False; MPI must be initialized."""
    if setting != "auto":
        return setting == "1"
    path = topology.loaded_mpi_library()
    answer = query(path)
    if answer is None:
        log.debug("mpitrain: %s does not say whether it is CUDA-aware; device "
                  "buffers will be staged through host memory (set "
                  "MPITRAIN_CUDA_AWARE=1 if it is)", path or "the MPI library")
    return bool(answer)
