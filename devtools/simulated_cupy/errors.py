"""The errors the simulated device raises: CuPy's own where CuPy has one
(callers catch them by name), and one of its own for what a real GPU would
do silently or crash on."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class SimulatedCudaError(RuntimeError):
    """What a real GPU would crash on (an illegal address, a sticky error) or
    get silently wrong (memory used after it was freed, a kernel without a
    numpy reference)."""


_RUNTIME_ERRORS = {1: ("cudaErrorInvalidValue", "invalid argument"),
                   2: ("cudaErrorMemoryAllocation", "out of memory"),
                   21: ("cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"),
                   101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
                   400: ("cudaErrorInvalidResourceHandle", "invalid resource handle")}


class CUDARuntimeError(RuntimeError):
    """As cupy_backends.cuda.api.runtime.CUDARuntimeError: made from a status."""

    def __init__(self, status):
        self.status = status
        name, text = _RUNTIME_ERRORS.get(status, (f"cudaError {status}", "unknown error"))
        super().__init__(f"{name}: {text}")


def runtime_error(status, detail):
    """A CUDARuntimeError whose message also says what the simulation saw."""
    error = CUDARuntimeError(status)
    error.args = (f"{error.args[0]} ({detail})",)
    return error


class OutOfMemoryError(MemoryError):
    """As cupy.cuda.memory.OutOfMemoryError, whose name callers report."""

    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: "
                         f"{total:,} bytes).")


def caller():
    """FILE:LINE of the nearest frame outside the simulation: where user code
    (mpitrain, a test) queued an operation or dropped an array."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_HERE):
            return f"{os.path.relpath(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
