"""A long sequence's recall blocks in offload mode: device blocks that hold the middle
blocks a decode step selected from the host tier, reused least recently used first, so
a step copies in only the blocks it lacks (``sparse_step``)."""

from __future__ import annotations

import heapq


class RecallCache:
    """A sequence's recall blocks: slots of ``per_block`` device blocks, each holding one
    middle retrieval block per (layer, KV head), reused least recently used first."""

    def __init__(self, per_block: int, num_layers: int, num_heads: int) -> None:
        self.block_ids: list[int] = []
        self.per_block = per_block
        self.num_heads = num_heads
        keys = num_layers * num_heads
        self._slot_of: list[dict[int, int]] = [{} for _ in range(keys)]  # block -> slot
        self._content: list[list[int]] = [[] for _ in range(keys)]       # slot -> block
        self._used: list[list[int]] = [[] for _ in range(keys)]          # slot -> step

    @property
    def slots(self) -> int:
        return len(self.block_ids) // self.per_block

    def grow(self, block_ids: list[int]) -> None:
        self.block_ids.extend(block_ids)
        for content, used in zip(self._content, self._used):
            content.extend([-1] * (self.slots - len(content)))
            used.extend([-1] * (self.slots - len(used)))

    def place(self, layer: int, head: int, wanted: list[int],
              step: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Slots holding ``wanted`` middle blocks, and the (block, slot) pairs to copy in:
        a block not held takes the least recently used slot that holds no wanted block
        (the lowest slot among equals). A step where every block is held sorts nothing."""
        key = layer * self.num_heads + head
        slot_of, content, used = self._slot_of[key], self._content[key], self._used[key]
        slots = [slot_of.get(b, -1) for b in wanted]
        missing = [i for i, s in enumerate(slots) if s < 0]
        copies = []
        if missing:
            want = set(wanted)
            spare = heapq.nsmallest(len(missing),
                                    (s for s in range(self.slots) if content[s] not in want),
                                    key=used.__getitem__)
            if len(spare) < len(missing):
                raise RuntimeError(f"recall cache: {len(missing)} blocks to place in "
                                   f"{len(spare)} free slots of {self.slots}; the scheduler "
                                   "grants a slot per selected block")
            for i, s in zip(missing, spare):
                b = wanted[i]
                slot_of.pop(content[s], None)
                slot_of[b], content[s] = s, b
                slots[i] = s
                copies.append((b, s))
        for s in slots:
            used[s] = step
        return slots, copies
