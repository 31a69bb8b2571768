"""A fused group's Stream (mpitrain.engine.execution.streaming) against numpy.

The shared-memory reducer asks a Stream, chunk by chunk, to fill a chunk's
inputs, to read them where they lie and to drain its results. Whatever the
tensors' sizes (empty ones, small ones packed together, large ones read in
place) and wherever a chunk starts and stops, what it hands over must be
exactly the group's concatenated inputs, and what it drains must land in
each output's own elements and nowhere else.
"""

import numpy as np
import pytest

from mpitrain.engine.execution.streaming import READ_MIN_ELEMENTS, Stream

SMALL, LARGE = 7, READ_MIN_ELEMENTS + 5


def layouts():
    """Sizes of fused groups: runs of small tensors between large ones."""
    yield [SMALL, 0, 3, LARGE, 1, 1, 2 * LARGE, 0]
    yield [LARGE]
    yield [1] * 40
    rng = np.random.default_rng(30)
    for _ in range(5):
        yield [int(rng.choice([0, 1, SMALL, 300, LARGE, 3 * LARGE])) for _ in range(25)]


def stream_of(counts, prescale=1.0, dtype=np.float32):
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    sources = [np.arange(count, dtype=dtype) + 1000 * k for k, count in enumerate(counts)]
    outputs = [np.full(count, -1, dtype=np.float32) for count in counts]
    scratch = np.full(sum(counts), np.nan, dtype=np.float32)
    stream = Stream(starts, counts, sources, outputs, prescale, 1.0,
                    np.dtype(np.float32), scratch)
    return stream, np.concatenate(sources).astype(np.float32) * prescale, outputs


def chunks(counts):
    """Chunk boundaries as the reducer might cut them: the whole group, fixed
    sizes around READ_MIN_ELEMENTS, and cuts at, just before and just after
    every tensor's edges."""
    total = sum(counts)
    yield [(0, total)]
    for size in (LARGE - 1, LARGE + 3):
        yield [(start, min(start + size, total)) for start in range(0, total, size)]
    edges = np.cumsum([0] + counts)
    cuts = sorted({0, total} | {int(cut) for edge in edges for cut in (edge - 1, edge, edge + 1)
                                if 0 < cut < total})
    yield list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("counts", list(layouts()), ids=lambda counts: f"{len(counts)}tensors")
@pytest.mark.parametrize("prescale", [1.0, 0.5])
def test_fill_and_read_hand_over_exactly_the_inputs(counts, prescale):
    stream, inputs, _ = stream_of(counts, prescale)
    for cuts in chunks(counts):
        for start, stop in cuts:
            filled = np.full(stop - start, np.nan, np.float32)
            stream.fill(start, stop, filled)
            np.testing.assert_array_equal(filled, inputs[start:stop],
                                          err_msg=f"fill {start}:{stop} of {counts}")
            pieces = stream.read(start, stop)
            if pieces is None:                    # scaled inputs must be filled
                assert prescale != 1.0
                continue
            read = np.full(stop - start, np.nan, np.float32)
            for offset, piece in pieces:
                assert np.isnan(read[offset:offset + piece.size]).all(), "pieces overlap"
                read[offset:offset + piece.size] = piece
            np.testing.assert_array_equal(read, inputs[start:stop],
                                          err_msg=f"read {start}:{stop} of {counts}")


def test_large_inputs_are_read_where_they_lie_and_small_ones_packed_once():
    counts = [SMALL, SMALL, SMALL, LARGE, SMALL]
    stream, _, _ = stream_of(counts)
    pieces = stream.read(0, sum(counts))
    assert [piece.size for _, piece in pieces] == [3 * SMALL, LARGE, SMALL]
    assert np.shares_memory(pieces[1][1], stream.sources[3])
    assert np.shares_memory(pieces[2][1], stream.sources[4])
    assert np.shares_memory(pieces[0][1], stream.scratch)


@pytest.mark.parametrize("counts", list(layouts()), ids=lambda counts: f"{len(counts)}tensors")
def test_drain_writes_each_output_its_own_results(counts):
    stream, _, outputs = stream_of(counts)
    total = sum(counts)
    results = np.arange(total, dtype=np.float32) * 3
    for cuts in chunks(counts):
        for output in outputs:
            output[...] = -1
        for start, stop in cuts:
            stream.drain(start, stop, results[start:stop].copy())
        np.testing.assert_array_equal(np.concatenate(outputs), results,
                                      err_msg=f"{len(cuts)} chunks of {counts}")
