"""How a chunked allreduce's input gets in and its result gets out.

Channel.allreduce and the host reducers (shared memory, hierarchical) reduce
a 1-D buffer a chunk at a time. A ChunkIO tells them, per chunk, where the
input comes from and where the result goes, so that a caller can write a
chunk right before it travels and use its result right after it arrives,
while it is still in cache, instead of passing over cold memory before and
after. ChunkIO itself is the plain buffer: it holds the input before the
call and the result after; PLAIN is that default. A caller overrides what
it needs:

- ``fills``: the input lies elsewhere; ``fill(start, stop, destination)``
  writes its elements start:stop into destination (stop - start elements of
  the buffer, or of shared memory) right before they travel.
- ``read(start, stop)``: the input's elements start:stop where they already
  lie, as (offset from start, array) pieces of the buffer's dtype, which a
  reducer may combine directly instead of filling them in first; None where
  they must first be filled (scaled, converted, or a joined rank's zeros).
- ``drains``: the result goes elsewhere; ``drain(start, stop, source)``
  takes the results of elements start:stop from source (the buffer, or
  shared memory), and the buffer's contents are then undefined.
- ``reduced(start, stop)``: otherwise, called once buffer[start:stop] holds
  its result.
"""


class ChunkIO:
    """The plain buffer: input in it before, result in it after."""

    fills = False
    drains = False

    def fill(self, start, stop, destination):
        """Write the input's elements start:stop into destination (only where fills)."""

    def read(self, start, stop):
        """The input's elements start:stop where they lie, or None: fill them."""
        return None

    def drain(self, start, stop, source):
        """Take the results of elements start:stop from source (only where drains)."""

    def reduced(self, start, stop):
        """buffer[start:stop] holds its result (only where not drains)."""

    def arrived(self, buffer, start, stop):
        """buffer[start:stop] holds the result of elements start:stop: hand it on."""
        if self.drains:
            self.drain(start, stop, buffer[start:stop])
        else:
            self.reduced(start, stop)


PLAIN = ChunkIO()
