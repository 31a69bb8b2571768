"""The per-round control vector, reduced across ranks with one bitwise AND.

Layout in 64-bit words: status flags, then three bit sets with one bit per
cache slot. "Every rank" sets travel as they are; "some rank" sets travel
inverted, because the AND of inverted bits is the inverted OR.
"""

import numpy as np

SHUTDOWN = 1      # some rank is shutting down its engine
UNCACHED = 2      # some rank has requests the cache cannot serve
JOINED = 4        # some rank has joined
REMOVED = 8       # some member knows the set was removed: this round is its last

_STATUS_MASK = (1 << 64) - 1


def words_for(nbits):
    return (nbits + 63) // 64


def encode(status, ready, invalid, submitted, nbits):
    """Build the vector this rank contributes.

    ready: slots this rank can execute now (joined ranks: every allreduce);
    invalid: slots whose cached response no longer fits this rank's request;
    submitted: slots this rank really submitted (never set by joined ranks).
    """
    width = words_for(nbits)
    full = (1 << (64 * width)) - 1
    parts = [(_STATUS_MASK ^ status).to_bytes(8, "little")]
    for value in (ready, full ^ invalid, full ^ submitted):
        parts.append(value.to_bytes(8 * width, "little"))
    return np.frombuffer(b"".join(parts), dtype=np.uint64).copy()


def decode(vector, nbits):
    """Return (status of any rank, ready everywhere, invalid anywhere, submitted anywhere)."""
    width = words_for(nbits)
    full = (1 << (64 * width)) - 1
    raw = vector.tobytes()
    status = _STATUS_MASK ^ int.from_bytes(raw[:8], "little")
    size = 8 * width
    ready = int.from_bytes(raw[8:8 + size], "little")
    invalid = full ^ int.from_bytes(raw[8 + size:8 + 2 * size], "little")
    submitted = full ^ int.from_bytes(raw[8 + 2 * size:], "little")
    return status, ready, invalid, submitted


def bits(value):
    """Yield the positions of the set bits of ``value``, lowest first."""
    while value:
        low = value & -value
        yield low.bit_length() - 1
        value ^= low
