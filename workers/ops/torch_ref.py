"""Reference ops in plain torch: they run on every device and are the oracle that
device kernels are tested against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvcache.block_summary import BlockSelector, ExactSelector
from kvcache.host_tier import copy_kv_blocks
from kvcache.kv_layout import LAYOUT_ND
from kvcache.kv_quant import dequantize_rows, quantize_rows
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from workers.ops.base import AttentionMetadata
from workers.ops.quant_linear import Int8Weight, quantize_weight, w8a8_linear, w8a16_blocked

if TYPE_CHECKING:
    from workers.ops.fused_decode import FusedDecode, LayerWeights


class TorchOps:
    name = "torch"
    kv_layout = LAYOUT_ND
    int8_kv = True

    def allocate_kv(self, shape: KVShape, num_blocks: int,
                    device: torch.device) -> list[torch.Tensor]:
        return allocate_kv_cache(shape, num_blocks, device)

    def pack_linear(self, weight: torch.Tensor | Int8Weight,
                    quantization: str = "none") -> torch.Tensor | Int8Weight:
        """``fp16`` (``quant_linear.head_quantization``) stores an fp32 weight in fp16."""
        if isinstance(weight, Int8Weight) or quantization == "none":
            return weight
        if quantization == "fp16":
            return weight.half() if weight.dtype == torch.float32 else weight
        return quantize_weight(weight, quantization)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, Int8Weight):
            return self.int8_linear(x, weight, bias)
        return F.linear(x, weight.to(x.dtype), bias)

    def fuse_decode(self, layers: Sequence[LayerWeights], final_norm: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int,
                    eps: float) -> FusedDecode | None:
        return None

    def int8_linear(self, x: torch.Tensor, weight: Int8Weight,
                    bias: torch.Tensor | None) -> torch.Tensor:
        if weight.scheme == "w8a8":
            return w8a8_linear(x, weight, bias)
        return w8a16_blocked(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + delta
        return h, self.rms_norm(h, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor | Int8Weight,
            down: torch.Tensor | Int8Weight) -> torch.Tensor:
        return self.linear(self.silu_and_mul(self.linear(x, gate_up)), down)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        return _rotate(q, c, s), _rotate(k, c, s)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        bs = kv_cache.shape[2]
        blocks, offsets = slot_mapping // bs, slot_mapping % bs   # any pool order (kv_tensors)
        for i, x in enumerate((k, v)):
            rows = quantize_rows(x) if kv_cache.dtype == torch.int8 else x.to(kv_cache.dtype)
            kv_cache[i].index_put_((blocks, offsets), rows)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale)
        for seg in meta.prefills:
            s, n = seg.query_start, seg.query_len
            # An int8 cache is read back even for a whole prompt: every attention then
            # sees the same stored keys, so a prefix-cache hit computes what a cold run does.
            if seg.context_len == n and kv_cache.dtype != torch.int8:
                ks, vs = k[s:s + n], v[s:s + n]
            else:
                ks, vs = self.read_context(kv_cache, seg.block_table, seg.context_len, q.dtype)
            out[s:s + n] = self.causal_attention(q[s:s + n], ks, vs, scale)
        return out

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """q [n, H, D] are the last n positions of a context of k/v [L, KVH, D]."""
        n, length = q.shape[0], k.shape[0]
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if n == length:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            rows = torch.arange(n, device=q.device)[:, None] + (length - n)
            mask = torch.arange(length, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        return o[0].transpose(0, 1)

    def read_context(self, kv_cache: torch.Tensor, block_table: torch.Tensor, length: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens' keys and values [length, KVH, D] as ``dtype``,
        from the context's pool blocks ``block_table`` (int8 rows dequantized)."""
        _, _, bs, kvh, width = kv_cache.shape
        nb = -(-length // bs)
        blocks = block_table[:nb]
        keys = _read(kv_cache[0][blocks].view(nb * bs, kvh, width)[:length], dtype)
        values = _read(kv_cache[1][blocks].view(nb * bs, kvh, width)[:length], dtype)
        return keys, values

    def block_selector(self, kind: str) -> BlockSelector:
        return ExactSelector(kind)

    def copy_kv_blocks(self, src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor,
                       dst_ids: torch.Tensor, head: int | None = None) -> None:
        copy_kv_blocks(src, src_ids, dst, dst_ids, head)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Always per KV head (a dense table broadcast over heads), so that a sparse
        selection of every block computes exactly what the dense decode does."""
        d, h, hd = q.shape
        _, _, bs, kvh, width = kv_cache.shape
        tables, lens = meta.decode_head_tables, meta.decode_head_lens
        if tables is None:
            w = meta.decode_block_tables.shape[1]
            tables = meta.decode_block_tables[:, None, :].expand(d, kvh, w)
            lens = meta.decode_seq_lens[:, None].expand(d, kvh)
        length = tables.shape[2] * bs
        heads = torch.arange(kvh, device=q.device)[None, :, None]
        # Each (sequence, head)'s blocks of its own head: [d, kvh, w, bs, hd].
        keys = _read(kv_cache[0].transpose(1, 2)[tables, heads].view(d, kvh, length, width),
                     q.dtype)
        values = _read(kv_cache[1].transpose(1, 2)[tables, heads].view(d, kvh, length, width),
                       q.dtype)
        qg = q.view(d, kvh, h // kvh, hd)
        scores = torch.matmul(qg, keys.transpose(2, 3)) * scale  # [d, kvh, g, L]
        pad = torch.arange(length, device=q.device) >= lens[:, :, None]
        scores.masked_fill_(pad[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).reshape(d, h, hd)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored KV rows as ``dtype`` (int8 rows dequantized)."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
