"""Ascend NPU ops through ``torch_npu``: the op path vllm-ascend takes, behind our seam.

Targets torch_npu releases matching the pinned torch (2.x.y.postN, the CANN 8.x toolkit
that release names); the calls follow the torch_npu documentation and vllm-ascend's call
sites:

- KV write: ``_npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)``;
  releases without it (it arrived with the ATB ops) take ``npu_scatter_pa_kv_cache(key,
  value, key_cache, value_cache, slot_mapping)``, whose keyword for the slots is
  ``slot_mapping``, not ``slot_indices``; ``cache_mode`` is left to its default, which
  releases that lack the keyword also use.
- decode: ``_npu_paged_attention`` over the block table (``context_lens`` int32).
- prefill and chunked prefill over a cached prefix: ND pools (910-class) use
  ``npu_fused_infer_attention_score`` with ``block_table``, ``input_layout="TND"``,
  cumulative ``actual_seq_lengths`` and per-sequence ``actual_seq_lengths_kv``, and
  ``sparse_mode=3`` over the 2048x2048 causal mask; NZ pools (310P) use
  ``_npu_paged_attention_splitfuse`` with rows of an additive causal mask, cast to NZ as
  vllm-ascend's 310P mask builder does.
- ``npu_rms_norm``, ``npu_add_rms_norm``, ``npu_swiglu``, and rotary through
  ``_npu_rotary_embedding`` (in place, neox halves, a ``[max_pos, D]`` cos|sin cache).
- W8A8 dynamic linear layers as vllm-ascend's w8a8_dynamic method runs them:
  ``npu_dynamic_quant(x)`` gives int8 rows and a float32 scale per token,
  ``npu_quant_matmul(qx, w, scale, pertoken_scale=..., bias=..., output_dtype=x.dtype)``
  takes the int8 weight transposed to [in, out] and cast to NZ once at load, with the
  float32 per-output-channel scales. ``npu_dynamic_quant`` takes float16/bfloat16 only,
  and 310P's ``npu_quant_matmul`` has no per-token scale, so both are refused at load.
  Its activations are symmetric, as the reference deployment's are, where the other
  devices' are asymmetric (``quant_linear.quantize_activations``): the same int8 weights,
  a coarser rounding of the activations.

310P devices (``get_device_name`` names them) get the fractal NZ KV layout, allocated
with ``empty_with_format(..., acl_format=29)``. Sparse (per-KV-head) decode tables have
no torch_npu op: they run the reference decode.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from kvcache.kv_layout import LAYOUT_ND, LAYOUT_NZ, nd_to_nz
from kvcache.kv_tensors import KVShape, allocate_kv_cache
from workers.ops.base import AttentionMetadata
from workers.ops.quant_linear import Int8Weight
from workers.ops.torch_ref import TorchOps

ACL_FORMAT_FRACTAL_NZ = 29
FIA_MASK_SIZE = 2048      # sparse_mode 3 reads a fixed 2048x2048 causal mask
W8A8_DTYPES = (torch.float16, torch.bfloat16)   # what npu_dynamic_quant quantizes


class NpuOps(TorchOps):
    name = "npu"
    int8_kv = False   # its KV-write and paged-attention calls take float pools only

    def __init__(self, torch_npu: ModuleType, soc_name: str) -> None:
        self.npu = torch_npu
        self.kv_layout = LAYOUT_NZ if "310P" in soc_name else LAYOUT_ND
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos table, cos|sin)
        self._fia_mask: torch.Tensor | None = None

    def allocate_kv(self, shape: KVShape, num_blocks: int,
                    device: torch.device) -> list[torch.Tensor]:
        if shape.layout == LAYOUT_ND:
            return allocate_kv_cache(shape, num_blocks, device)
        return [self.npu.empty_with_format(size=shape.layer_shape(num_blocks), dtype=shape.dtype,
                                           device=device, acl_format=ACL_FORMAT_FRACTAL_NZ).zero_()
                for _ in range(shape.num_layers)]

    def pack_linear(self, weight: torch.Tensor | Int8Weight,
                    quantization: str = "none") -> torch.Tensor | Int8Weight:
        packed = super().pack_linear(weight, quantization)
        if not isinstance(packed, Int8Weight) or packed.scheme != "w8a8":
            return packed
        if self.kv_layout == LAYOUT_NZ:
            raise ValueError("quantization: got 'w8a8' on an Ascend 310P, whose "
                             "npu_quant_matmul takes no per-token scales; use w8a16 or none")
        if not isinstance(weight, Int8Weight) and weight.dtype not in W8A8_DTYPES:
            raise ValueError(f"quantization: 'w8a8' on the NPU needs model.dtype float16 or "
                             f"bfloat16 (npu_dynamic_quant's inputs); got "
                             f"{str(weight.dtype).removeprefix('torch.')}")
        nz = self.npu.npu_format_cast(packed.qweight_t, ACL_FORMAT_FRACTAL_NZ)
        return dataclasses.replace(packed, qweight_t=nz)

    def int8_linear(self, x: torch.Tensor, weight: Int8Weight,
                    bias: torch.Tensor | None) -> torch.Tensor:
        if weight.scheme != "w8a8":
            return super().int8_linear(x, weight, bias)
        qx, token_scale = self.npu.npu_dynamic_quant(x.reshape(-1, x.shape[-1]))
        out = self.npu.npu_quant_matmul(qx, weight.qweight_t, weight.scale,
                                        pertoken_scale=token_scale, bias=bias,
                                        output_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], weight.out_features)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, _, s = self.npu.npu_add_rms_norm(h, delta, weight, epsilon=eps)
        return s, y

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.npu.npu_swiglu(x, dim=-1)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0] is not cos:
            self._rope = (cos, torch.cat((cos, sin), dim=-1))
        t, hd = q.shape[0], q.shape[-1]
        q2, k2 = q.reshape(t, -1).contiguous(), k.reshape(t, -1).contiguous()
        self.npu._npu_rotary_embedding(positions, q2, k2, hd, self._rope[1], True)
        return q2.view(q.shape), k2.view(k.shape)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        k, v = k.to(kv_cache.dtype).contiguous(), v.to(kv_cache.dtype).contiguous()
        slots = slot_mapping.to(torch.int32)
        if hasattr(self.npu, "_npu_reshape_and_cache"):
            self.npu._npu_reshape_and_cache(key=k, value=v, key_cache=kv_cache[0],
                                            value_cache=kv_cache[1], slot_indices=slots)
        else:
            self.npu.npu_scatter_pa_kv_cache(key=k, value=v, key_cache=kv_cache[0],
                                             value_cache=kv_cache[1], slot_mapping=slots)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd and meta.decode_head_tables is not None:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale)
        elif nd:
            self.npu._npu_paged_attention(
                query=q[:nd].contiguous(), key_cache=kv_cache[0], value_cache=kv_cache[1],
                num_kv_heads=k.shape[1], num_heads=q.shape[1], scale_value=scale,
                block_table=meta.decode_block_tables.to(torch.int32),
                context_lens=self._lens(meta.decode_seq_lens, q.device), out=out[:nd])
        if meta.prefills:
            prefill = self._prefill_nz if self.kv_layout == LAYOUT_NZ else self._prefill_nd
            out[nd:] = prefill(q[nd:].contiguous(), k.shape[1], kv_cache, meta, scale)
        return out

    def _lens(self, lens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Context lengths, int32, where the kernel reads them: on the host for 910's
        paged attention, on the device for 310P's (as vllm-ascend passes them)."""
        return lens.to(device="cpu" if self.kv_layout == LAYOUT_ND else device,
                       dtype=torch.int32)

    def _tables(self, meta: AttentionMetadata) -> torch.Tensor:
        """The prefill segments' block tables, padded to one width, int32."""
        width = max(seg.block_table.numel() for seg in meta.prefills)
        device = meta.prefills[0].block_table.device
        tables = torch.zeros(len(meta.prefills), width, dtype=torch.int32, device=device)
        for i, seg in enumerate(meta.prefills):
            tables[i, :seg.block_table.numel()] = seg.block_table.clamp(min=0)
        return tables

    def _prefill_nd(self, q: torch.Tensor, num_kv_heads: int, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self._fia_mask is None or self._fia_mask.device != q.device:
            self._fia_mask = torch.ones(FIA_MASK_SIZE, FIA_MASK_SIZE, dtype=torch.bool,
                                        device=q.device).triu_(1)
        nb, bs = kv_cache.shape[1], kv_cache.shape[2]
        q_ends, total = [], 0
        for seg in meta.prefills:
            total += seg.query_len
            q_ends.append(total)
        out, _ = self.npu.npu_fused_infer_attention_score(
            q, kv_cache[0].view(nb, bs, -1), kv_cache[1].view(nb, bs, -1),
            atten_mask=self._fia_mask, block_table=self._tables(meta), input_layout="TND",
            block_size=bs, actual_seq_lengths=q_ends,
            actual_seq_lengths_kv=[seg.context_len for seg in meta.prefills],
            num_key_value_heads=num_kv_heads, num_heads=q.shape[1], scale=scale,
            sparse_mode=3)
        return out.view(q.shape)

    def _prefill_nz(self, q: torch.Tensor, num_kv_heads: int, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
        positions = torch.cat([torch.arange(s.context_len - s.query_len, s.context_len)
                               for s in meta.prefills])
        width = -(-max(s.context_len for s in meta.prefills) // 16) * 16
        rows = torch.zeros(positions.numel(), width, dtype=torch.float16)
        rows.masked_fill_(torch.arange(width)[None, :] > positions[:, None], float("-inf"))
        mask = self.npu.npu_format_cast(nd_to_nz(rows).to(q.device), ACL_FORMAT_FRACTAL_NZ)
        out = torch.empty_like(q)
        self.npu._npu_paged_attention_splitfuse(
            query=q, key_cache=kv_cache[0], value_cache=kv_cache[1], mask=mask,
            block_table=self._tables(meta),
            seq_len=torch.tensor([s.query_len for s in meta.prefills], dtype=torch.int32),
            context_lens=self._lens(torch.tensor([s.context_len for s in meta.prefills]),
                                    q.device),
            num_kv_heads=num_kv_heads, num_heads=q.shape[1], scale_value=scale, out=out)
        return out
