"""The recycled pool of out-of-place results keeps what a step needs, and makes room.

A job's results change sizes (another model in the same process, evaluation
after training): the memory kept for the old sizes must serve the new ones
instead of leaving every new result to fresh pages.
"""

from mpitrain.backends.recycled import MIN_BYTES, RecycledBuffers

MIB = 1 << 20


def addresses(buffers):
    return sorted(buffer.ctypes.data for buffer in buffers)


def test_a_step_holding_many_buffers_of_one_size_gets_them_all_back():
    pool = RecycledBuffers()
    first = [pool.take(MIB) for _ in range(10)]
    kept = addresses(first)
    del first
    assert addresses([pool.take(MIB) for _ in range(10)]) == kept


def test_new_sizes_take_the_room_of_idle_old_ones_beyond_the_limit():
    pool = RecycledBuffers(most_bytes=4 * MIB)
    old = [pool.take(MIB) for _ in range(4)]
    assert pool.kept_bytes == 4 * MIB
    del old
    new = [pool.take(2 * MIB) for _ in range(2)]
    assert pool.kept_bytes == 4 * MIB              # the old sizes let go
    kept = addresses(new)
    del new
    assert addresses([pool.take(2 * MIB) for _ in range(2)]) == kept


def test_buffers_still_held_are_never_given_away_or_let_go():
    pool = RecycledBuffers(most_bytes=2 * MIB)
    held = [pool.take(MIB) for _ in range(2)]
    held[0][:] = 7
    other = pool.take(2 * MIB)                     # no room: the held ones stay
    assert pool.kept_bytes == 2 * MIB and other.size == 2 * MIB
    assert (held[0] == 7).all()
    again = pool.take(MIB)
    assert again.ctypes.data not in addresses(held)


def test_small_buffers_are_left_to_malloc():
    pool = RecycledBuffers()
    pool.take(MIN_BYTES - 64)
    assert pool.kept_bytes == 0
