"""The recurrent-state slots of a hybrid model's running sequences, decided with integers.

A Gated DeltaNet layer keeps a fixed-size state per sequence (conv inputs and the delta rule's matrix), however
long the sequence is, so its cache is not paged: each running sequence holds one slot of the backend's state
arrays from admission to finish, abort or preemption. The memory belongs to the backend
(`backend.allocate_kv_cache(..., num_state_slots)`); this module only decides which sequence owns which slot.
A slot's old contents need no clearing here: a sequence's first step starts at position 0, where the model zeroes
its slot.
"""

from __future__ import annotations

import heapq


class StatePool:
    """`num_slots` state slots, each free or held by one sequence."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap: the lowest free slot goes first, so runs are reproducible

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        """A free slot (the lowest); the caller checks num_free first."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} recurrent-state slots are held")
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"recurrent-state slot {slot} is not held")
        heapq.heappush(self._free, slot)
