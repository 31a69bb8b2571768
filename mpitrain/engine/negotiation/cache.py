"""The response cache: steady-state tensors negotiate through one bit each.

Every rank holds an identical cache: entries are added, touched and removed
only while processing a negotiation round, in the same order on every rank,
so a slot number means the same tensor everywhere. The ``signature`` stored
with an entry is this rank's own; shapes of allgather may differ per rank.

When full, the cache drops its least recently used entry. If a name it
dropped comes back, the names a step uses do not fit: dropping the least
recent one would then drop the very name needed next, and every tensor
would negotiate through the coordinator each step. The cache makes room
for each name that returns instead, with one warning. Names that never
return (a step number in the name) keep the capacity as it is.
"""

import collections
import logging

from mpitrain.ops import OpType

log = logging.getLogger("mpitrain")

HIT, INVALID, MISS = range(3)

CACHEABLE = frozenset({OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST,
                       OpType.ALLTOALL, OpType.REDUCESCATTER})


class ResponseCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self._slots = []                      # slot -> (response, signature) or None
        self._by_name = {}                    # name -> slot
        self._recent = collections.OrderedDict()   # slot, least recently used first
        self._dropped = collections.OrderedDict()  # names dropped for room, oldest first
        self._warned = False
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
        elif self._dropped.pop(response.name, False):
            self._grow()
        if len(self._by_name) >= self.capacity:
            self._drop_least_recent()
        try:
            slot = self._slots.index(None)
            self._slots[slot] = (response, signature)
        except ValueError:
            slot = len(self._slots)
            self._slots.append((response, signature))
        self._by_name[response.name] = slot
        self._recent[slot] = None
        self.generation += 1

    def _drop_least_recent(self):
        slot = next(iter(self._recent))
        self._dropped[self._slots[slot][0].name] = True
        if len(self._dropped) > self.capacity:
            self._dropped.popitem(last=False)
        self.erase(slot)

    def _grow(self):
        if not self._warned:
            self._warned = True
            log.warning("the response cache holds %d names, fewer than the job "
                        "uses again and again: it grows to hold them. Set "
                        "MPITRAIN_CACHE_CAPACITY to the number of tensors a step "
                        "submits, or more, to start at that size", self.capacity)
        self.capacity += 1

    def erase(self, slot):
        entry = self._slots[slot]
        if entry is None:
            return
        self._slots[slot] = None
        del self._by_name[entry[0].name]
        del self._recent[slot]
        self.generation += 1
