"""The response cache: steady-state tensors negotiate through one bit each.

Every rank holds an identical cache: entries are added, touched and removed
only while processing a negotiation round, in the same order on every rank,
so a slot number means the same tensor everywhere. The ``signature`` stored
with an entry is this rank's own; shapes of allgather may differ per rank.
"""

import collections

from mpitrain.ops import OpType

HIT, INVALID, MISS = range(3)

CACHEABLE = frozenset({OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST,
                       OpType.ALLTOALL, OpType.REDUCESCATTER})


class ResponseCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self._slots = []                      # slot -> (response, signature) or None
        self._by_name = {}                    # name -> slot
        self._recent = collections.OrderedDict()   # slot, least recently used first
        self.generation = 0                   # changes whenever an entry is added or removed

    @property
    def nbits(self):
        """Number of slots ever used; identical on every rank."""
        return len(self._slots)

    def lookup(self, name, signature):
        slot = self._by_name.get(name)
        if slot is None:
            return MISS, None
        if self._slots[slot][1] != signature:
            return INVALID, slot
        return HIT, slot

    def slot_bit(self, name):
        """The bit of ``name``'s slot, or 0 where it is not cached."""
        slot = self._by_name.get(name)
        return 0 if slot is None else 1 << slot

    def response(self, slot):
        return self._slots[slot][0]

    def kind(self, slot):
        entry = self._slots[slot]
        return None if entry is None else entry[0].kind

    def occupied(self):
        return [slot for slot, entry in enumerate(self._slots) if entry is not None]

    def touch(self, slots):
        """Mark slots as just used, in order (every rank does the same)."""
        move = self._recent.move_to_end
        for slot in slots:
            move(slot)

    def put(self, response, signature):
        if self.capacity == 0:
            return
        if response.name in self._by_name:
            self.erase(self._by_name[response.name])
        if len(self._by_name) >= self.capacity:
            self.erase(next(iter(self._recent)))
        try:
            slot = self._slots.index(None)
            self._slots[slot] = (response, signature)
        except ValueError:
            slot = len(self._slots)
            self._slots.append((response, signature))
        self._by_name[response.name] = slot
        self._recent[slot] = None
        self.generation += 1

    def erase(self, slot):
        entry = self._slots[slot]
        if entry is None:
            return
        self._slots[slot] = None
        del self._by_name[entry[0].name]
        del self._recent[slot]
        self.generation += 1
