"""Int8 KV: symmetric int8 with one fp32 scale per token and KV head.

A stored row is the head's ``head_dim`` int8 values followed by the 4 bytes of its
scale, so an int8 pool is ``(2, num_blocks, block_size, kv_heads, head_dim + 4)`` of
int8: the scales live inside the blocks, and everything that moves or copies blocks
(prefix caching, the Arrow handoff, the host tier) carries them without knowing.
``head_dim`` 64 stores 68 bytes per row against fp16's 128.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
_QMAX = 127.0


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Stored elements per (token, KV head) row."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_dim] as int8 rows [..., head_dim + 4] (values, then scale)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax))
    q = torch.round(xf / scale).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] as ``dtype`` [..., head_dim]."""
    values = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (values.float() * scale).to(dtype)
