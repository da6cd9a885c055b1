"""Int8 KV: symmetric int8 with one fp16 scale per token and KV head.

A stored row is the head's ``head_dim`` int8 values followed by the 2 bytes of its
scale, so an int8 pool is ``(2, num_blocks, block_size, kv_heads, head_dim + 2)`` of
int8: the scales live inside the blocks, and everything that moves or copies blocks
(prefix caching, the Arrow handoff, the host tier) carries them without knowing.
``head_dim`` 64 stores 66 bytes per row against fp16's 128 (1.94x the tokens; an fp32
scale would give 1.88x). The values are quantized with the fp16-rounded scale, so
the rounding of the scale costs nothing beyond it.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
_QMAX = 127.0


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Stored elements per (token, KV head) row."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def value_width(row: int, dtype: torch.dtype) -> int:
    """The head size of stored rows ``row`` elements wide (``row_width``'s inverse)."""
    return row - SCALE_BYTES if dtype == torch.int8 else row


def quantize_rows(x: torch.Tensor, rounding=torch.round) -> torch.Tensor:
    """``x`` [..., head_dim] as int8 rows [..., head_dim + 2] (values, then scale).

    ``rounding`` ``torch.floor`` or ``torch.ceil`` instead rounds every value down or up,
    so the row dequantizes to a lower or upper bound of ``x`` (block summaries' bounds);
    the scale is then rounded up to fp16, so that no value needs the clamp."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _QMAX, torch.ones_like(amax)).half()
    if rounding is not torch.round:
        up = torch.nextafter(scale, torch.tensor(float("inf"), dtype=scale.dtype))
        scale = torch.where(scale.float() * _QMAX < amax, up, scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # below fp16's range
    q = rounding(xf / scale.float()).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + 2] as ``dtype`` [..., head_dim]."""
    values = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    return (values.float() * scale).to(dtype)
