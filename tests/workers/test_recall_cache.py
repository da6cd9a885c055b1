"""The recall cache's slot choice, against placements worked out by hand."""

import pytest

from workers.recall_cache import RecallCache


def _cache(slots: int) -> RecallCache:
    cache = RecallCache(per_block=2, num_layers=2, num_heads=2)
    cache.grow(list(range(100, 100 + 2 * slots)))
    return cache


def test_first_placement_fills_slots_in_order_and_copies_every_block():
    cache = _cache(3)
    assert cache.slots == 3
    assert cache.place(0, 0, [7, 3], step=1) == ([0, 1], [(7, 0), (3, 1)])


def test_held_blocks_are_hits_and_misses_take_the_least_recently_used_free_slot():
    cache = _cache(3)
    cache.place(0, 0, [7, 3], step=1)        # slot 0: 7, slot 1: 3
    cache.place(0, 0, [5], step=2)           # slot 2 (never used): 5
    cache.place(0, 0, [7], step=3)           # hit: slot 0 used at 3
    # 3 (slot 1, step 1) is the least recently used; 7 is wanted, so slot 0 stays.
    assert cache.place(0, 0, [7, 9], step=4) == ([0, 1], [(9, 1)])
    # Now slot 2 (5, step 2) is the oldest; a hit on 9 and a miss on 3.
    assert cache.place(0, 0, [9, 3], step=5) == ([1, 2], [(3, 2)])


def test_equal_ages_give_the_lowest_slot_and_each_layer_head_has_its_own_slots():
    cache = _cache(4)
    assert cache.place(1, 1, [4, 8], step=1) == ([0, 1], [(4, 0), (8, 1)])
    # Layer 0 head 1 has seen nothing: its slots are all free.
    assert cache.place(0, 1, [4], step=1) == ([0], [(4, 0)])
    # Slots 2 and 3 never used (equal ages): the lower one first.
    assert cache.place(1, 1, [4, 8, 6], step=2) == ([0, 1, 2], [(6, 2)])


def test_more_misses_than_free_slots_is_refused_with_the_counts():
    cache = _cache(2)
    cache.place(0, 0, [1, 2], step=1)
    with pytest.raises(RuntimeError, match="2 blocks to place in 1 free slots of 2"):
        cache.place(0, 0, [1, 3, 4], step=2)
