"""Adasum, Horovod's adaptive summation, over MPI point-to-point messages.

Two vectors a and b combine as

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient is 1 where its vector's norm is 0), each tensor of a fused
buffer with its own dot product and norms. Across 2^k ranks the combination
follows Horovod's tree. At levels d = 1, 2, 4, ... a rank and its partner
(rank ^ d) hold the same span of the buffer: the lower rank keeps the first
half, the higher the second, and they swap the other halves. The 2d ranks
whose rank // 2d agree now hold, between them, the whole of both vectors
being combined, in slices: they sum each tensor's partial dot product and
squared norms (an allreduce among those ranks), and each combines its slice.
Then the slices travel back, level by level in reverse (recursive doubling),
until every rank holds the whole result. The result is not divided by the
number of ranks.

Dot products and norms accumulate in float64; the buffer itself is float32
or float64 (16-bit floats arrive widened to float32, mpitrain.backends.dtypes).
"""

import numpy as np

from mpitrain.transport.channel import as_bytes, starts_of

# Horovod's threshold below which a squared norm counts as 0: sqrt(DBL_MIN).
TINY_NORM = float(np.sqrt(np.finfo(np.float64).tiny))
# Elements per dot product: widened to float64 this many at a time, and few
# enough that OpenBLAS computes each on the calling thread (it starts its
# threads from 10000 up, and those spin against the ranks on a busy machine:
# 2-30 times slower on 2 ranks sharing 2 cores).
PIECE_ELEMENTS = 8192


def allreduce(channel, buffer, counts):
    """Adasum-combine the 1-D host ``buffer`` in place across the channel's ranks.

    counts: elements of each tensor, one after another in ``buffer``. The
    channel's size must be a power of two (mpitrain.ops.adasum_size_problem).
    """
    rank, size = channel.rank, channel.size
    tensor_starts = starts_of(counts)
    received = np.empty((buffer.size + 1) // 2, buffer.dtype)
    spans = []
    low, high = 0, buffer.size
    distance = 1
    while distance < size:
        partner = rank ^ distance
        middle = low + (high - low) // 2
        first = not rank & distance           # this rank keeps the first half
        keep, give = ((low, middle), (middle, high)) if first else \
                     ((middle, high), (low, middle))
        mine = buffer[keep[0]:keep[1]]
        theirs = received[:mine.size]
        yield from channel.exchange({partner: as_bytes(buffer[give[0]:give[1]])},
                                     {partner: as_bytes(theirs)})
        sums = _dot_and_norms(mine, theirs, keep[0], tensor_starts, first)
        yield from _sum_in_block(channel, sums, distance)
        _combine(mine, theirs, keep[0], tensor_starts, sums, first)
        spans.append((low, high))
        low, high = keep
        distance <<= 1
    while spans:
        distance >>= 1
        partner = rank ^ distance
        outer_low, outer_high = spans.pop()
        other = (high, outer_high) if low == outer_low else (outer_low, low)
        yield from channel.exchange({partner: as_bytes(buffer[low:high])},
                                     {partner: as_bytes(buffer[other[0]:other[1]])})
        low, high = outer_low, outer_high


def _pieces(offset, length, tensor_starts):
    """(tensor, start, stop) within a slice of ``length`` elements that begins at
    ``offset`` in the buffer, for every tensor that overlaps it."""
    for tensor in range(len(tensor_starts) - 1):
        start = max(tensor_starts[tensor], offset) - offset
        stop = min(tensor_starts[tensor + 1], offset + length) - offset
        if start < stop:
            yield tensor, start, stop


def _dot_and_norms(mine, theirs, offset, tensor_starts, first):
    """Per tensor: [a.b, |first rank's|^2, |second rank's|^2] over this slice,
    in float64, so that partners sum and read them alike."""
    sums = np.zeros((len(tensor_starts) - 1, 3))
    for tensor, start, stop in _pieces(offset, mine.size, tensor_starts):
        a, b = mine[start:stop], theirs[start:stop]
        dot, aa, bb = _products(a, b)
        sums[tensor] = (dot, aa, bb) if first else (dot, bb, aa)
    return sums


def _products(a, b):
    """(a.b, a.a, b.b) accumulated in float64."""
    dot = aa = bb = 0.0
    for start in range(0, a.size, PIECE_ELEMENTS):
        x = a[start:start + PIECE_ELEMENTS].astype(np.float64, copy=False)
        y = b[start:start + PIECE_ELEMENTS].astype(np.float64, copy=False)
        dot += float(x @ y)
        aa += float(x @ x)
        bb += float(y @ y)
    return dot, aa, bb


def _sum_in_block(channel, sums, distance):
    """Sum ``sums`` over the 2 * distance ranks of this rank's block, by
    recursive doubling: partners add the same two values, so every rank of
    the block gets the same bits."""
    incoming = np.empty_like(sums)
    step = 1
    while step <= distance:
        partner = channel.rank ^ step
        yield from channel.exchange({partner: as_bytes(sums)},
                                     {partner: as_bytes(incoming)})
        sums += incoming
        step <<= 1


def _combine(mine, theirs, offset, tensor_starts, sums, first):
    """mine = Adasum(mine, theirs), each tensor's piece with its coefficients."""
    for tensor, start, stop in _pieces(offset, mine.size, tensor_starts):
        dot, first_norm, second_norm = sums[tensor]
        first_coefficient = _coefficient(dot, first_norm)
        second_coefficient = _coefficient(dot, second_norm)
        own, other = ((first_coefficient, second_coefficient) if first
                      else (second_coefficient, first_coefficient))
        a, b = mine[start:stop], theirs[start:stop]
        a *= own
        b *= other
        a += b


def _coefficient(dot, norm_squared):
    return 1.0 - dot / (2.0 * norm_squared) if norm_squared >= TINY_NORM else 1.0
