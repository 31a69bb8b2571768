"""The arrays this rank's operations in flight read and write.

An operation reads its input and writes its output (an in-place call writes
its input). Any number of operations in flight may read one array; none may
write an array that another one in flight reads or writes, since the result
would then depend on which ran first. Arrays are told apart by the address
their data starts at, so two views of one buffer that start elsewhere
(``a[:5]`` and ``a[5:]``) are different arrays, and overlapping views that
start elsewhere are not caught.
"""

import numpy as np

from mpitrain.backends.host import host_address


def address(array):
    """Where ``array``'s data starts, in host or device memory; None if empty."""
    if array is None or array.size == 0:
        return None
    if type(array) is np.ndarray:
        return host_address(array)
    return array.data.ptr


class MemoryClaims:
    """One process set's claims; the caller holds the engine's lock."""

    def __init__(self):
        self.readers = {}      # address -> names of the operations reading it
        self.writers = {}      # address -> name of the operation writing it

    def claim(self, handle):
        """Record what ``handle`` reads and writes, or return why it may not."""
        target = address(handle.output)
        source = None if handle.output is handle.input else address(handle.input)
        if target == source:
            source = None                  # in place: writing covers reading
        if target is not None:
            other = self.writers.get(target) or next(iter(self.readers.get(target, ())),
                                                     None)
            if other is not None:
                return _conflict("writes", other)
        if source is not None and source in self.writers:
            return _conflict("reads", self.writers[source])
        if target is not None:
            self.writers[target] = handle.name
        if source is not None:
            self.readers.setdefault(source, []).append(handle.name)
        handle.claimed = (source, target)
        return None

    def release(self, handle):
        source, target = handle.claimed
        handle.claimed = None
        if target is not None:
            del self.writers[target]
        if source is not None:
            names = self.readers[source]
            names.remove(handle.name)
            if not names:
                del self.readers[source]


def _conflict(does, other):
    return (f"it {does} an array that '{other}' still uses on this rank; an array "
            "in flight may be read by any number of operations, but written (in "
            "place, or as output=) only by one that nothing else uses: "
            f"synchronize '{other}' first, or pass a copy")
