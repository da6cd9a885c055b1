"""CUDA attention behind the ops seam: FlashAttention's paged kernel where it is
installed and the pool's blocks fit it, torch SDPA (flash / memory-efficient kernels)
otherwise. Norms, rotary and the MLP stay the reference ops, which are plain CUDA
kernels there.

``flash_attn_with_kvcache`` reads our ND pool as is: ``kv_cache[0]`` is ``(num_blocks,
block_size, kv_heads, head_dim)``, its paged K layout, with a per-sequence ``block_table``
and ``cache_seqlens`` (the new tokens already written), and a causal mask aligned to the
end of the context, so one call per prefill segment covers chunks over a cached prefix.
FlashAttention 2 takes pages of a multiple of 256 tokens: smaller blocks use SDPA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.ops.base import AttentionMetadata
from workers.ops.quant_linear import Int8Weight
from workers.ops.torch_ref import TorchOps

FLASH_PAGE_MULTIPLE = 256


def load_flash_attn() -> Callable | None:
    """``flash_attn_with_kvcache`` when flash-attn is installed and imports, else None."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except (ImportError, OSError, RuntimeError):
        return None
    return flash_attn_with_kvcache


class CudaOps(TorchOps):
    name = "cuda"
    int8_kv = False   # flash-attn and the SDPA path read float pools only

    def __init__(self, flash_attn_with_kvcache: Callable | None) -> None:
        self.flash = flash_attn_with_kvcache

    def int8_linear(self, x: torch.Tensor, weight: Int8Weight,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """w8a8 pads its tokens with zero rows to a row count the int8 product takes: each
        row is quantized and multiplied on its own, so the real rows' results are those of
        an unpadded product."""
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        size = int_mm_rows(n, rows.shape[1])
        if weight.scheme != "w8a8" or n == size:
            return super().int8_linear(x, weight, bias)
        padded = rows.new_zeros(size, rows.shape[1])
        padded[:n] = rows
        out = super().int8_linear(padded, weight, bias)[:n]
        return out.reshape(*x.shape[:-1], weight.out_features)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.flash is not None and meta.block_size % FLASH_PAGE_MULTIPLE == 0 \
                and meta.decode_head_tables is None:
            return self._flash(q, kv_cache, meta, scale)
        return self._sdpa(q, k, v, kv_cache, meta, scale)

    def _flash(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self.flash(
                q[:nd].unsqueeze(1), kv_cache[0], kv_cache[1],
                cache_seqlens=meta.decode_seq_lens.to(torch.int32),
                block_table=meta.decode_block_tables.to(torch.int32),
                softmax_scale=scale, causal=True).squeeze(1)
        for seg in meta.prefills:
            s, n = seg.query_start, seg.query_len
            lens = torch.full((1,), seg.context_len, dtype=torch.int32, device=q.device)
            out[s:s + n] = self.flash(
                q[s:s + n].unsqueeze(0), kv_cache[0], kv_cache[1], cache_seqlens=lens,
                block_table=seg.block_table.to(torch.int32).unsqueeze(0),
                softmax_scale=scale, causal=True).squeeze(0)
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Decodes as one padded SDPA call over the gathered blocks; prefills as the
        reference does (SDPA, causal over the context)."""
        nd = meta.num_decode_tokens
        if not nd or meta.decode_head_tables is not None:
            return super().attention(q, k, v, kv_cache, meta, scale)
        out = torch.empty_like(q)
        if meta.prefills:
            prefill_meta = AttentionMetadata(meta.slot_mapping, 0, meta.decode_block_tables[:0],
                                             meta.decode_seq_lens[:0], meta.prefills,
                                             meta.block_size)
            out = super().attention(q, k, v, kv_cache, prefill_meta, scale)
        tables = meta.decode_block_tables
        length = tables.shape[1] * meta.block_size
        _, _, bs, kvh, hd = kv_cache.shape
        keys = kv_cache[0][tables].view(nd, length, kvh, hd).transpose(1, 2).to(q.dtype)
        values = kv_cache[1][tables].view(nd, length, kvh, hd).transpose(1, 2).to(q.dtype)
        visible = torch.arange(length, device=q.device) < meta.decode_seq_lens[:, None]
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys, values,
                                           attn_mask=visible[:, None, None, :], scale=scale,
                                           enable_gqa=True)
        out[:nd] = o.squeeze(2)
        return out


def int_mm_rows(n: int, in_features: int) -> int:
    """The fewest rows, at least ``n``, that cuBLASLt's int8 product (``torch._int_mm``)
    takes: more than 16 (torch's check), and with fewer than 128 input columns a multiple
    of 32. Probed on an H100 over 17-300 rows, 64-1536 input and 96-1536 output columns:
    64 input columns failed at every other row count, 128 and more at none."""
    if in_features < 128:
        return max(32, -(-n // 32) * 32)
    return max(n, 17)
