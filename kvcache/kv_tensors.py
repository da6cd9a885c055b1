"""Preallocated KV memory of one pool, in the ND layout (or NZ, see ``kv_layout``).

One tensor per layer, ``(2, num_blocks, block_size, kv_heads, head_dim)``: index 0
holds keys and 1 values, so a block's K and V of a layer are two contiguous slabs
and a token's slot is ``block_id * block_size + offset``. The layers are consecutive
views of one allocation, so a KV handoff moves a block of every layer in one torch op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.kv_layout import LAYOUT_ND, block_shape


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
                      buffer: memoryview | None = None) -> list[torch.Tensor]:
    """The pool's layers; over the start of ``buffer`` (zeroed host memory, such as a
    shared segment) when given, else a fresh zeroed allocation on ``device``."""
    dims = (shape.num_layers, *shape.layer_shape(num_blocks))
    if buffer is None:
        pool = torch.zeros(dims, dtype=shape.dtype, device=device)
    else:
        if device.type != "cpu":
            raise ValueError(f"kv pool buffer: got one for device {device}; a buffer holds "
                             "host memory, so only a cpu pool can live in it")
        pool = torch.frombuffer(buffer, dtype=shape.dtype, count=math.prod(dims)).view(dims)
    return list(pool.unbind(0))


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Flat slots of ``positions`` in a sequence whose blocks are ``block_table``."""
    return block_table[positions // block_size] * block_size + positions % block_size
