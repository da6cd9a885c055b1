"""Preallocated KV memory of one pool, in the ND layout (or NZ, see ``kv_layout``).

One tensor per layer, ``(2, num_blocks, block_size, kv_heads, head_dim)``: index 0
holds keys and 1 values, a block's K (or V) of a layer is one contiguous slab, and a
token's slot is ``block_id * block_size + offset``. The layers are views of one
allocation, in one of two orders:

- layer-major (the default): each layer's tensor is contiguous, as device kernels
  (flash-attn, torch_npu) read it;
- block-major: a block's slabs of every layer lie together, in KV-batch row order
  (layer, K/V), so a block is one contiguous run. Peers copy whole blocks out of a
  shared pool: one run a block instead of ``2 * layers`` scattered slabs copied at
  1.2-1.4x memcpy's rate against 0.75-0.88x (fp16, 4 KB pages). Decode pays for it:
  steps up to ~10% slower with fp16 KV, a few percent with fp32
  (``benchmarks/RESULTS.md``, issue #19).
  Kernels reach a block through the layer tensor's ``stride(1)``.

``pool_runs`` recognises either order from the tensors' strides.

A host pool of 2 MB or more is a private mapping advised for transparent huge pages
(``MADV_HUGEPAGE``): torch's allocator only asks for them when ``THP_MEM_ALLOC_ENABLE``
is set before its first allocation, and on a kernel whose THP mode is ``madvise`` (the
common default) 4 KB pages made decode attention over 64K-128K tokens 15-30% slower,
dense or sparse (``benchmarks/RESULTS.md``, "Huge pages for the KV pool"). Like ``torch.zeros``,
the mapping is zeroed and faulted in as it is used.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.kv_layout import LAYOUT_ND, block_shape

_HUGE_PAGE = 2 << 20


@dataclass(frozen=True)
class KVShape:
    """``head_dim``: elements stored per (token, KV head) row, ``kv_quant.row_width``
    (an int8 row also holds its scale)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: str = LAYOUT_ND

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's K (or V) of one layer in this pool's layout."""
        return block_shape(self.layout, self.block_size, self.num_kv_heads, self.head_dim,
                           self.dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * int(np.prod(self.block_shape)) * elem

    def num_blocks_for(self, budget_bytes: int) -> int:
        n = budget_bytes // self.bytes_per_block
        if n < 1:
            raise ValueError(
                f"kv_cache_bytes: got {budget_bytes}; one block of this model needs "
                f"{self.bytes_per_block} bytes; raise the budget")
        return int(n)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, *self.block_shape)


def allocate_kv_cache(shape: KVShape, num_blocks: int, device: torch.device,
                      buffer: memoryview | mmap.mmap | None = None,
                      block_major: bool = False) -> list[torch.Tensor]:
    """The pool's layers, in either order (module docstring); over the start of
    ``buffer`` (zeroed host memory, such as a shared segment) when given, else a fresh
    zeroed allocation on ``device`` (on huge pages for a large host pool: module
    docstring)."""
    dims = ((num_blocks, shape.num_layers, 2) if block_major
            else (shape.num_layers, 2, num_blocks)) + shape.block_shape
    count = math.prod(dims)
    if buffer is None and device.type == "cpu" and count * shape.dtype.itemsize >= _HUGE_PAGE:
        buffer = huge_page_memory(count * shape.dtype.itemsize)
    if buffer is None:
        memory = torch.zeros(dims, dtype=shape.dtype, device=device)
    else:
        if device.type != "cpu":
            raise ValueError(f"kv pool buffer: got one for device {device}; a buffer holds "
                             "host memory, so only a cpu pool can live in it")
        memory = torch.frombuffer(buffer, dtype=shape.dtype, count=count).view(dims)
    pool = memory.permute(1, 2, 0, *range(3, len(dims))) if block_major else memory
    return list(pool.unbind(0))


def huge_page_memory(nbytes: int) -> mmap.mmap:
    """``nbytes`` of zeroed private host memory advised for transparent huge pages
    (module docstring); a tensor made over it with ``torch.frombuffer`` keeps it mapped."""
    memory = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def pool_runs(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The pool as ``(runs, num_blocks, elems)``: each block's elements as ``runs``
    contiguous runs in KV-batch row order (layer, K/V), one in a block-major pool and
    ``2 * layers`` in a layer-major one; None unless the layers are one allocation in
    one of those orders (``allocate_kv_cache``'s)."""
    first = kv_caches[0]
    layers, num_blocks = len(kv_caches), first.shape[1]
    slab = math.prod(first.shape[2:])
    if not blocks_contiguous(first):
        return None
    if first.stride()[:2] == (num_blocks * slab, slab):
        step, shape = 2 * num_blocks * slab, (2 * layers, num_blocks, slab)
    elif first.stride()[:2] == (slab, 2 * layers * slab):
        step, shape = 2 * slab, (1, num_blocks, 2 * layers * slab)
    else:
        return None
    storage, start = first.untyped_storage().data_ptr(), first.data_ptr()
    if not all(kv.untyped_storage().data_ptr() == storage and kv.stride() == first.stride()
               and kv.data_ptr() == start + i * step * first.element_size()
               for i, kv in enumerate(kv_caches)):
        return None
    return first.as_strided(shape, (shape[1] * shape[2], shape[2], 1))


def blocks_contiguous(kv: torch.Tensor) -> bool:
    """Whether each block of a layer ``kv`` [2, num_blocks, *block] is contiguous, as both
    orders keep it."""
    step = 1
    for n, stride in zip(reversed(kv.shape[2:]), reversed(kv.stride()[2:])):
        if n != 1 and stride != step:
            return False
        step *= n
    return True


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Flat slots of ``positions`` in a sequence whose blocks are ``block_table``."""
    return block_table[positions // block_size] * block_size + positions % block_size
