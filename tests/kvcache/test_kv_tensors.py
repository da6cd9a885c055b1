"""The host KV pool's memory: zeroed, one mapping advised for huge pages, freed with it."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from kvcache.kv_tensors import KVShape, allocate_kv_cache

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping holding ``address``, with its range
    as ``span``."""
    fields: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            if fields is not None:
                return fields
            if int(span[1], 16) <= address < int(span[2], 16):
                fields = {"span": span[0]}
        elif fields is not None and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def _spans() -> set[str]:
    """Every mapping's address range: a freed pool's range may be reused in part by
    smaller mappings, so the whole range is what must be gone."""
    return {line.split()[0] for line in Path("/proc/self/maps").read_text().splitlines()}


@pytest.mark.skipif(not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(),
                    reason="transparent huge pages not in madvise mode: torch's own "
                           "allocations would get them too (always) or nothing would (never)")
@pytest.mark.parametrize("block_major", [False, True])
def test_a_host_pool_is_one_zeroed_mapping_eligible_for_huge_pages(block_major):
    shape = KVShape(4, 16, 3, 64, torch.float32)   # 24 KB a block: 4.7 MB
    kv = allocate_kv_cache(shape, 200, torch.device("cpu"), block_major=block_major)
    assert all(layer.shape == (2, 200, 16, 3, 64) and not layer.any() for layer in kv)
    mapping = _mapping_of(kv[0].data_ptr())
    assert mapping is not None and mapping["THPeligible"] == "1"
    assert all(_mapping_of(layer.data_ptr())["span"] == mapping["span"] for layer in kv[1:])
    kv[3][1, 199].fill_(2.0)
    assert kv[3].sum() == 2.0 * 16 * 3 * 64 and not kv[2].any()
    del kv
    gc.collect()
    assert mapping["span"] not in _spans()   # unmapped with the last layer tensor


def test_a_pool_under_one_huge_page_is_an_ordinary_allocation():
    shape = KVShape(1, 16, 1, 64, torch.float32)
    (kv,) = allocate_kv_cache(shape, 4, torch.device("cpu"))
    assert kv.shape == (2, 4, 16, 1, 64) and not kv.any()
    assert kv.untyped_storage().nbytes() == 2 * 4 * 16 * 64 * 4
