"""An entry: this rank's submission of one named operation."""

import time

QUEUED, CACHED, SENT = range(3)   # waiting to be sorted, served by the cache, at the coordinator


class Entry:
    """This rank's submission of one named operation."""

    __slots__ = ("request", "signature", "dtype", "input", "output", "splits",
                 "handle", "enqueued", "state", "slot", "generation", "successor")

    def __init__(self, request, dtype, input, output, handle, splits=None):
        self.request = request
        self.signature = request.signature()
        self.dtype = dtype
        self.input = input
        self.output = output
        self.splits = splits
        self.handle = handle          # None: a local error already raised to the caller
        self.enqueued = time.monotonic()
        self.state = QUEUED
        self.slot = None              # the cache slot, while CACHED ...
        self.generation = -1          # ... as of this cache generation
        self.successor = None         # the same name, submitted again after a local error
