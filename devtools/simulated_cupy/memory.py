"""Simulated device memory: where every address comes from, a pool that
poisons freed blocks and hands them out again first, and pinned host memory.

Device memory is host memory underneath (numpy buffers that live as long as
the process), so that MPI can read it where the simulation says MPI is
CUDA-aware; but every access from a queued operation goes through
``host_view``, which refuses an address that is not device memory of the
kind the operation may touch, and memory used after it was freed (in
quarantine mode). Nothing outside the simulation gets a host view: the
arrays refuse numpy (see ndarray.py).

CuPy's pool keeps a freed block for the stream it was allocated on and gives
it to the next allocation of that size on that stream; here freeing also
queues a fill of 0xFF bytes (NaN in every float type, -1 in the integers) on
that stream, so whoever reads it afterwards sees garbage, not the old values
that would hide a lifetime bug.
"""

import bisect
import ctypes
import mmap
import weakref

import numpy as np

from devtools.simulated_cupy.errors import OutOfMemoryError, SimulatedCudaError, caller, \
    runtime_error

POISON = 0xFF
_ROUND = 512                 # CuPy's pool rounds allocations up to this
DEVICE, EXTERNAL, PINNED = "device memory", "device memory (a torch tensor's)", \
    "pinned host memory"


class Region:
    """One allocation: [start, start + size)."""

    __slots__ = ("start", "size", "kind", "device", "freed_at", "fault_after_free",
                 "owner", "users", "watch")

    def __init__(self, start, size, kind, device, owner):
        self.start, self.size, self.kind, self.device = start, size, kind, device
        self.freed_at = None      # FILE:LINE where it was last freed
        self.fault_after_free = kind == PINNED   # else reading it gives garbage
        self.owner = owner        # what keeps the bytes alive
        self.users = 0            # external memory: the arrays over it
        self.watch = None         # pinned memory: a weak reference to its pointer


class Registry:
    """Every allocation the simulation knows, by address."""

    def __init__(self):
        self._starts = []
        self._regions = {}

    def add(self, region):
        bisect.insort(self._starts, region.start)
        self._regions[region.start] = region

    def remove(self, region):
        self._starts.pop(bisect.bisect_left(self._starts, region.start))
        del self._regions[region.start]

    def at(self, start):
        return self._regions.get(start)

    def find(self, address, nbytes):
        """The region holding [address, address + nbytes), or None."""
        index = bisect.bisect_right(self._starts, address) - 1
        if index < 0:
            return None
        region = self._regions[self._starts[index]]
        if address + nbytes <= region.start + region.size:
            return region
        return None


def extent(pointer, shape, strides, itemsize):
    """(lowest address, bytes) that an array of this layout touches; (pointer, 0) if empty."""
    if any(n == 0 for n in shape):
        return pointer, 0
    low = high = pointer
    for n, stride in zip(shape, strides):
        if stride < 0:
            low += stride * (n - 1)
        else:
            high += stride * (n - 1)
    return low, high - low + itemsize


class Memory:
    """One allocation on a device, as cupy.cuda.Memory: ``ptr``, ``size``,
    ``device_id``. A pool block goes back to its pool when the last array
    over it goes."""

    def __init__(self, ptr, size, device_id, release=None):
        self.ptr, self.size, self.device_id = ptr, size, device_id
        self._release = release

    @property
    def device(self):
        from devtools.simulated_cupy.streams import Device
        return Device(self.device_id)

    def __int__(self):
        return self.ptr

    def __del__(self):
        if self._release is not None:
            self._release()


class MemoryPointer:
    """A place in a Memory, as cupy.cuda.MemoryPointer: ``ptr``, ``mem``."""

    def __init__(self, mem, offset):
        self.mem = mem
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    @property
    def device(self):
        return self.mem.device

    def __int__(self):
        return self.ptr

    def __add__(self, offset):
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + offset)


class _Block:
    __slots__ = ("storage", "ptr", "size", "stream", "region")


class Pool:
    """One device's memory: CuPy's pool (free lists per stream and size, the
    last freed first) over a fixed capacity, and cudaMalloc's raw blocks."""

    def __init__(self, device, settings, registry, scheduler):
        self.device = device
        self.capacity = settings.memory
        self.quarantine = settings.quarantine
        self.registry = registry
        self.scheduler = scheduler
        self.used = 0                 # bytes held: in use, cached in free lists, raw
        self._free = {}               # (stream ptr, size) -> [block]
        self._cached = 0

    def allocate(self, nbytes, stream):
        """A Memory of at least ``nbytes`` for ``stream``; OutOfMemoryError if none."""
        if nbytes == 0:
            return Memory(0, 0, self.device)
        size = -(-nbytes // _ROUND) * _ROUND
        with self.scheduler.lock:
            self.scheduler.check()
            cached = self._free.get((stream.ptr, size))
            if cached:
                block = cached.pop()
                self._cached -= size
                block.region.freed_at = None
            else:
                block = self._new_block(size, stream)
        return Memory(block.ptr, nbytes, self.device, lambda: self._free_block(block))

    def _new_block(self, size, stream):
        if self.used + size > self.capacity:
            self.free_all_blocks()             # as CuPy does before giving up
        if self.used + size > self.capacity:
            raise OutOfMemoryError(size, self.used)
        block = _Block()
        block.storage = np.empty(size, np.uint8)
        block.storage.fill(POISON)            # cudaMalloc's memory is not zeroed
        block.ptr = block.storage.ctypes.data
        block.size = size
        block.stream = stream
        block.region = Region(block.ptr, size, DEVICE, self.device, block.storage)
        self.registry.add(block.region)
        self.used += size
        return block

    def _free_block(self, block):
        with self.scheduler.lock:
            if self.scheduler.closed:
                return
            region, start, size = block.region, block.ptr, block.size
            region.freed_at = caller()
            if self.quarantine:
                # Freed in stream order, as the pool hands it out: work queued
                # on its stream before the free may still use it.
                self.scheduler.enqueue(block.stream._queue, "quarantine of freed memory",
                                       lambda: setattr(region, "fault_after_free", True),
                                       [(start, size)])
                return                         # never handed out again
            self.scheduler.enqueue(block.stream._queue, "poison of freed memory",
                                   lambda: _fill(start, size, POISON), [(start, size)])
            self._free.setdefault((block.stream.ptr, size), []).append(block)
            self._cached += size

    def free_all_blocks(self):
        """Give the cached blocks back, after the device has finished (cudaFree
        waits for it too)."""
        with self.scheduler.lock:
            self.scheduler.run_everything()
            for blocks in self._free.values():
                for block in blocks:
                    self.registry.remove(block.region)
                    self.used -= block.size
            self._free.clear()
            self._cached = 0

    def malloc(self, nbytes):
        """cudaMalloc: a raw block outside the pool (its pages are not touched)."""
        with self.scheduler.lock:
            if self.used + nbytes > self.capacity:
                raise runtime_error(2, f"{nbytes} bytes, {self.capacity - self.used} free")
            storage = np.empty(max(nbytes, 1), np.uint8)
            region = Region(storage.ctypes.data, nbytes, DEVICE, self.device, storage)
            self.registry.add(region)
            self.used += nbytes
            return region.start

    def free(self, ptr):
        with self.scheduler.lock:
            region = self.registry.at(ptr)
            if region is None or region.kind != DEVICE:
                raise runtime_error(1, f"{ptr:#x} was not returned by cudaMalloc")
            self.scheduler.run_everything()
            self.registry.remove(region)
            self.used -= region.size

    def used_bytes(self):
        return self.used - self._cached

    def total_bytes(self):
        return self.used


def _fill(start, size, value):
    ctypes.memset(start, value, size)


def host_view(registry, pointer, shape, strides, dtype, kinds, what):
    """A numpy view of memory the simulation owns, for a queued operation to
    read or write; SimulatedCudaError where a GPU would fault or read freed memory."""
    dtype = np.dtype(dtype)
    low, nbytes = extent(pointer, shape, strides, dtype.itemsize)
    if nbytes == 0:
        return np.empty(shape, dtype)
    region = registry.find(low, nbytes)
    if region is None or region.kind not in kinds:
        where = ("no memory the simulated device knows" if region is None
                 else region.kind)
        raise SimulatedCudaError(
            f"{what} touches {nbytes} bytes at {low:#x}, which is {where}; it may "
            f"touch only {' or '.join(kinds)} (an illegal address on a GPU)")
    if region.freed_at is not None and region.fault_after_free:
        raise SimulatedCudaError(
            f"{what}: use after free (freed at {region.freed_at}) of {region.kind} "
            f"at {low:#x}")
    buffer = (ctypes.c_char * nbytes).from_address(low)
    return np.ndarray(shape, dtype, buffer=buffer, offset=pointer - low, strides=strides)


# -- memory owned by others: torch tensors over host memory --------------------

def external(registry, scheduler, start, size, device, owner):
    """A Memory over [start, start + size) that ``owner`` keeps alive (a torch
    tensor's storage, seen as device memory through tests/ torch seam)."""
    with scheduler.lock:
        region = registry.at(start)
        if region is not None and region.kind == EXTERNAL and region.size < size:
            registry.remove(region)                  # a storage that grew
            region = None
        if region is None:
            region = Region(start, size, EXTERNAL, device, None)
            registry.add(region)
        elif region.kind != EXTERNAL:
            raise SimulatedCudaError(f"a torch tensor at {start:#x} lies in {region.kind}")
        region.users += 1

    def release():
        with scheduler.lock:
            region.users -= 1
            if region.users == 0:
                # Queued work may still touch it: keep owner and region until the
                # device is idle.
                scheduler.when_idle(lambda kept=owner: _forget(registry, region))
    return Memory(start, size, device, release)


def _forget(registry, region):
    if region.users == 0 and registry.at(region.start) is region:
        registry.remove(region)


# -- pinned host memory -----------------------------------------------------------

_pinned_types = {}


def _pinned_type(size):
    """A ctypes array type of ``size`` bytes named PinnedMemoryPointer: numpy
    takes it through the buffer protocol, as it takes CuPy's."""
    found = _pinned_types.get(size)
    if found is None:
        found = _pinned_types[size] = type("PinnedMemoryPointer", (ctypes.c_ubyte * size,), {
            "ptr": property(lambda self: ctypes.addressof(self)),
            "size": lambda self: size,
        })
    return found


def alloc_pinned(registry, scheduler, size):
    """Page-locked host memory of ``size`` bytes, poisoned. When the pointer
    goes, its memory is poisoned and any later access raises (it stays mapped,
    so a stale address can never reach another allocation)."""
    mapping = mmap.mmap(-1, max(size, 1))
    pointer = _pinned_type(max(size, 1)).from_buffer(mapping)
    start = ctypes.addressof(pointer)
    _fill(start, max(size, 1), POISON)
    region = Region(start, max(size, 1), PINNED, -1, mapping)
    with scheduler.lock:
        registry.add(region)

    def freed(_):
        with scheduler.lock:
            region.freed_at = caller()
            _fill(start, region.size, POISON)
    region.watch = weakref.ref(pointer, freed)
    return pointer
