"""cupy.ndarray on the simulated device: memory that host code cannot read.

An array is a layout (address, shape, strides, dtype) over simulated device
memory. numpy refuses it (``__array__`` raises, there is no buffer protocol
and no ``__array_interface__``), so a device array that reaches host-only
code fails there, as it crashes on a GPU. MPI gets ``__cuda_array_interface__``
only where the simulation says MPI is CUDA-aware, and only for memory that no
queued operation still writes or reads.

Arithmetic, copies and fills are queued on the current stream, capturing
layouts, not arrays, and run when something waits (scheduler.py). Views,
reshapes and indexing compute layouts only and queue nothing.
"""

import ctypes

import ml_dtypes
import numpy as np

from devtools.simulated_cupy import simulation
from devtools.simulated_cupy.memory import DEVICE, EXTERNAL, MemoryPointer, extent, \
    host_view
from devtools.simulated_cupy.streams import Device, current_device, current_stream

_DEVICE_KINDS = (DEVICE, EXTERNAL)
NO_ARITHMETIC = (np.dtype(ml_dtypes.bfloat16),)    # CuPy may lack bfloat16 math


class Layout:
    """What a queued operation keeps of an array: where and how it lies."""

    __slots__ = ("ptr", "shape", "strides", "dtype")

    def __init__(self, array):
        self.ptr, self.shape = array.data.ptr, array.shape
        self.strides, self.dtype = array.strides, array.dtype

    def view(self, what):
        return host_view(simulation.state().registry, self.ptr, self.shape,
                         self.strides, self.dtype, _DEVICE_KINDS, what)

    @property
    def touch(self):
        return extent(self.ptr, self.shape, self.strides, self.dtype.itemsize)


def enqueue(label, run, arrays, stream=None, touches_known=True):
    """Queue ``run`` on ``stream`` (the current one); it touches ``arrays``
    (and, unless ``touches_known``, memory it finds through pointers)."""
    for array in arrays:
        if array.device.id != current_device():
            raise ValueError(f"{label}: the array is on GPU {array.device.id}, but the "
                             f"current device is GPU {current_device()}")
    touches = [Layout(a).touch for a in arrays] if touches_known else None
    stream = current_stream() if stream is None else stream
    simulation.state().scheduler.enqueue(stream._queue, label, run, touches)


class _Flags:
    def __init__(self, c_contiguous, f_contiguous):
        self.c_contiguous, self.f_contiguous = c_contiguous, f_contiguous
        self.owndata = False

    def __getitem__(self, name):
        return {"C_CONTIGUOUS": self.c_contiguous,
                "F_CONTIGUOUS": self.f_contiguous}[name]


def _contiguous(shape, strides, itemsize, order):
    expected = itemsize
    dims = zip(reversed(shape), reversed(strides)) if order == "C" else zip(shape, strides)
    if any(n == 0 for n in shape):
        return True
    for n, stride in dims:
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


class ndarray:
    """An array in simulated device memory."""

    __array_ufunc__ = None            # numpy's ufuncs refuse it too
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(n) for n in shape)
        dtype = np.dtype(dtype)
        if strides is None:
            strides, step = [], dtype.itemsize
            for n in reversed(shape):
                strides.insert(0, step)
                step *= max(n, 1)
        if memptr is None:
            device = current_device()
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            memptr = MemoryPointer(simulation.state().pool(device).allocate(
                nbytes, current_stream()), 0)
        self._data, self._shape = memptr, shape
        self._strides, self._dtype = tuple(int(s) for s in strides), dtype

    # -- what it is ---------------------------------------------------------------

    shape = property(lambda self: self._shape)
    strides = property(lambda self: self._strides)
    dtype = property(lambda self: self._dtype)
    data = property(lambda self: self._data)
    ndim = property(lambda self: len(self._shape))
    size = property(lambda self: int(np.prod(self._shape, dtype=np.int64)))
    itemsize = property(lambda self: self._dtype.itemsize)
    nbytes = property(lambda self: self.size * self._dtype.itemsize)

    @property
    def device(self):
        return Device(self._data.device_id)

    @property
    def flags(self):
        return _Flags(_contiguous(self._shape, self._strides, self.itemsize, "C"),
                      _contiguous(self._shape, self._strides, self.itemsize, "F"))

    @property
    def T(self):
        return self.transpose()

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of unsized object")
        return self._shape[0]

    def __repr__(self):
        return (f"<simulated cupy.ndarray shape={self._shape} dtype={self._dtype} "
                f"strides={self._strides} on GPU {self._data.device_id} at "
                f"{self._data.ptr:#x}>")

    # -- host code cannot read it ----------------------------------------------------

    def __array__(self, dtype=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly. (simulated "
                        "device memory reached host code)")

    @property
    def __cuda_array_interface__(self):
        """For MPI: only a CUDA-aware one may read device memory, and only once
        no queued work touches it. mpi4py turns a refusal into its own
        TypeError, so the device keeps why, and its next call raises it."""
        state = simulation.state()
        state.scheduler.check()
        low, nbytes = Layout(self).touch
        if not state.settings.cuda_aware_mpi:
            state.scheduler.fail(
                f"device memory at {low:#x} ({nbytes} bytes) was handed to MPI, which "
                "is not CUDA-aware here: it would read it as host memory (add "
                "cuda-aware-mpi to MPITRAIN_TEST_SIMULATED_GPU to simulate one)")
        waiting = state.scheduler.pending_touch(low, nbytes)
        if waiting is not None:
            state.scheduler.fail(f"device memory at {low:#x} ({nbytes} bytes) was handed "
                                 f"to MPI while {waiting} has not run: synchronize first")
        return {"shape": self._shape, "typestr": self._dtype.str,
                "descr": self._dtype.descr, "data": (self._data.ptr, False),
                "strides": None if self.flags.c_contiguous else self._strides,
                "version": 3, "stream": None}

    def get(self, stream=None, order="C", out=None, blocking=True):
        from devtools.simulated_cupy.functions import asnumpy
        return asnumpy(self, stream=stream, order=order, out=out, blocking=blocking)

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    __float__ = lambda self: float(self.item())
    __int__ = lambda self: int(self.item())
    __bool__ = lambda self: bool(self.item())

    # -- layouts: views, reshapes, indexing --------------------------------------------

    def _template(self):
        """A numpy array with this layout, over the same addresses, for computing
        the layouts of views (never for reading: nothing queued has run)."""
        low, nbytes = Layout(self).touch
        if nbytes == 0:
            return np.ndarray(self._shape, self._dtype, buffer=b"",
                              strides=(0,) * len(self._shape))
        buffer = (ctypes.c_char * nbytes).from_address(low)
        return np.ndarray(self._shape, self._dtype, buffer=buffer,
                          offset=self._data.ptr - low, strides=self._strides)

    def _like(self, template):
        """An array over this one's memory with ``template``'s layout."""
        if template.size == 0 or self.size == 0:
            pointer = self._data
        else:
            address = template.__array_interface__["data"][0]
            pointer = MemoryPointer(self._data.mem, address - self._data.mem.ptr)
        return ndarray(template.shape, template.dtype, pointer, template.strides)

    def view(self, dtype=None):
        if dtype is None:
            return self._like(self._template())
        return self._like(self._template().view(dtype))

    def reshape(self, *shape, order="C"):
        shape = shape[0] if len(shape) == 1 and not np.isscalar(shape[0]) else shape
        try:
            return self._like(np.reshape(self._template(), shape, order=order, copy=False))
        except ValueError:
            if np.prod(shape) != self.size and -1 not in shape:
                raise
            return self.copy().reshape(shape)          # CuPy copies where it must

    def ravel(self):
        return self.reshape(-1)

    def transpose(self, *axes):
        return self._like(self._template().transpose(*axes))

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, (ndarray, np.ndarray, list)) for k in key):
            raise NotImplementedError("the simulated device takes basic indexing only")
        if Ellipsis not in key:
            key += (Ellipsis,)         # a view, even where every axis is indexed
        return self._like(self._template()[key])

    def __setitem__(self, key, value):
        from devtools.simulated_cupy.functions import copyto
        copyto(self[key], value, casting="unsafe")

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    # -- copies and arithmetic, queued --------------------------------------------------

    def copy(self, order="C"):
        from devtools.simulated_cupy.functions import copyto
        result = ndarray(self._shape, self._dtype)
        copyto(result, self)
        return result

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        dtype = np.dtype(dtype)
        if dtype == self._dtype and not copy:
            return self
        from devtools.simulated_cupy.functions import copyto
        result = ndarray(self._shape, dtype)
        copyto(result, self, casting="unsafe")
        return result

    def fill(self, value):
        from devtools.simulated_cupy.functions import copyto
        copyto(self, value, casting="unsafe")


def elementwise(ufunc, *operands, out=None, dtype=None, casting="same_kind"):
    """``ufunc`` of device arrays and scalars, queued on the current stream."""
    arrays = [a for a in operands if isinstance(a, ndarray)]
    for operand in operands:
        if not isinstance(operand, ndarray) and not np.isscalar(operand):
            raise TypeError(f"Unsupported type {type(operand)} (the simulated CuPy takes "
                            "device arrays and scalars)")
    for array in arrays + ([out] if out is not None else []):
        if array.dtype in NO_ARITHMETIC:
            raise TypeError(f"{ufunc.__name__} on {array.dtype}: CuPy need not do "
                            "arithmetic on this type; copy it by its bits")
    probe = [np.empty(0, a.dtype) if isinstance(a, ndarray) else a for a in operands]
    result = ufunc(*probe, dtype=dtype)
    shape = np.broadcast_shapes(*[a.shape for a in arrays])
    if out is None:
        out = ndarray(shape, result.dtype)
    elif np.broadcast_shapes(shape, out.shape) != out.shape:
        raise ValueError(f"{ufunc.__name__}: out has shape {out.shape}, the result {shape}")
    elif not np.can_cast(result.dtype, out.dtype, casting):
        raise TypeError(f"{ufunc.__name__}: cannot cast {result.dtype} to {out.dtype} "
                        f"with casting rule '{casting}'")
    layouts = [Layout(a) if isinstance(a, ndarray) else a for a in operands]
    target = Layout(out)
    label = f"elementwise {ufunc.__name__}"

    def run():
        views = [l.view(label) if isinstance(l, Layout) else l for l in layouts]
        with np.errstate(all="ignore"):
            ufunc(*views, out=target.view(label), dtype=dtype, casting="unsafe")

    enqueue(label, run, arrays + [out])
    return out


def _binary(ufunc, reflected=False, in_place=False):
    def method(self, other):
        if isinstance(other, np.ndarray):
            return NotImplemented
        operands = (other, self) if reflected else (self, other)
        return elementwise(ufunc, *operands, out=self if in_place else None)
    return method


for _name, _ufunc in [("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                      ("truediv", np.true_divide), ("floordiv", np.floor_divide),
                      ("mod", np.remainder), ("pow", np.power), ("and", np.bitwise_and),
                      ("or", np.bitwise_or), ("xor", np.bitwise_xor)]:
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
    setattr(ndarray, f"__r{_name}__", _binary(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _binary(_ufunc, in_place=True))
for _name, _ufunc in [("lt", np.less), ("le", np.less_equal), ("gt", np.greater),
                      ("ge", np.greater_equal), ("eq", np.equal), ("ne", np.not_equal)]:
    setattr(ndarray, f"__{_name}__", _binary(_ufunc))
ndarray.__neg__ = lambda self: elementwise(np.negative, self)
ndarray.__invert__ = lambda self: elementwise(np.invert, self)
ndarray.__abs__ = lambda self: elementwise(np.absolute, self)
