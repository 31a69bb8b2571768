"""cupy.RawModule and cupy.RawKernel: CUDA sources run by numpy references.

A kernel runs here only if a numpy reference is registered for its exact
source, by the source's SHA-256: editing a kernel's CUDA code fails every
launch until its reference (and the hash it is pinned to) is updated to
match. mpitrain's own kernels have theirs in kernel_references.py; a test
registers the references of the kernels it writes itself.

A launch is queued on the current stream like any other work. A reference
gets a Launch: the arguments as given (device arrays as views, read when the
launch runs) and the device memory at any address, checked as the device
would fault on it.
"""

import hashlib

import numpy as np

from devtools.simulated_cupy import simulation
from devtools.simulated_cupy.errors import SimulatedCudaError
from devtools.simulated_cupy.memory import DEVICE, EXTERNAL, host_view
from devtools.simulated_cupy.ndarray import Layout, enqueue, ndarray

ARRAY = "a device array"
_references = {}         # sha256 of a source -> {function name: (signature, reference)}


def digest(code):
    return hashlib.sha256(code.encode()).hexdigest()


def register(code, name, signature, reference):
    """Run ``name`` of ``code`` by ``reference(launch)``. ``signature`` lists each
    argument's type: ARRAY or a numpy scalar type (np.int32, ...)."""
    _references.setdefault(digest(code), {})[name] = (tuple(signature), reference)


class Launch:
    """What a reference sees of one launch."""

    def __init__(self, name, args):
        self.name = name
        self._args = args              # Layouts for arrays, numpy scalars as given

    def array(self, index):
        """Argument ``index`` (a device array) as a writable numpy view."""
        return self._args[index].view(f"kernel {self.name}'s argument {index}")

    def scalar(self, index):
        return self._args[index]

    def memory(self, address, count, dtype, what):
        """``count`` elements of ``dtype`` of device memory at ``address``, as a
        kernel reaches them through a pointer it was handed in memory."""
        dtype = np.dtype(dtype)
        return host_view(simulation.state().registry, int(address), (int(count),),
                         (dtype.itemsize,), dtype, (DEVICE, EXTERNAL),
                         f"kernel {self.name}: {what}")


class Function:
    """One kernel of a module, launched as ``kernel(grid, block, args)``."""

    def __init__(self, name, signature, reference):
        self._name, self._signature, self._reference = name, signature, reference

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None,
                 enable_cooperative_groups=False):
        args = tuple(args)
        if len(args) != len(self._signature):
            raise SimulatedCudaError(f"kernel {self._name} takes {len(self._signature)} "
                                     f"arguments, was given {len(args)}")
        for index, (arg, kind) in enumerate(zip(args, self._signature)):
            wanted = ndarray if kind == ARRAY else kind
            if type(arg) is not wanted:
                raise SimulatedCudaError(
                    f"kernel {self._name}'s argument {index} must be {wanted.__name__}, "
                    f"got {type(arg).__name__}: the kernel would read its bytes as "
                    "another type")
        launch = Launch(self._name, [Layout(a) if isinstance(a, ndarray) else a
                                    for a in args])
        reference = self._reference
        # What the kernel touches through pointers in memory is unknown here.
        enqueue(f"kernel {self._name}", lambda: reference(launch),
                [a for a in args if isinstance(a, ndarray)], stream, touches_known=False)


class RawModule:
    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc",
                 translate_cucomplex=False, enable_cooperative_groups=False,
                 name_expressions=None, jitify=None):
        self.code = code
        self._functions = None

    def compile(self, log_stream=None):
        if self._functions is None:
            found = _references.get(digest(self.code))
            if found is None:
                raise SimulatedCudaError(
                    f"no numpy reference for this CUDA source (sha256 "
                    f"{digest(self.code)[:16]}...): a kernel was changed or added; give "
                    "it a reference and pin its hash in "
                    "devtools/simulated_cupy/kernel_references.py (or register one in "
                    "the test that wrote it)")
            self._functions = found

    def get_function(self, name):
        self.compile()
        if name not in self._functions:
            raise SimulatedCudaError(f"the module has no kernel {name!r} with a reference")
        return Function(name, *self._functions[name])


class RawKernel(Function):
    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False,
                 *, enable_cooperative_groups=False, jitify=None):
        function = RawModule(code=code).get_function(name)
        super().__init__(name, function._signature, function._reference)
        self.name = name
