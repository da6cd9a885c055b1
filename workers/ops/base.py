"""The ops seam: everything a decoder layer does that depends on the device or the
KV layout. A model calls only these; a device backend replaces them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvcache.block_summary import BlockSelector
from kvcache.kv_tensors import KVShape
from workers.ops.quant_linear import Int8Weight

if TYPE_CHECKING:
    from workers.ops.fused_decode import FusedDecode, LayerWeights


@dataclass
class PrefillSegment:
    """One sequence's run of query tokens beyond the decodes of a step."""

    query_start: int
    query_len: int
    context_len: int          # tokens in the sequence's KV after this step
    block_table: torch.Tensor  # [num_blocks] int64, enough blocks for context_len


@dataclass
class AttentionMetadata:
    """Where a step's tokens live in the paged KV pool.

    The first ``num_decode_tokens`` tokens are single-token decodes, one per sequence,
    described by the ``decode_*`` tensors; the rest are prefill segments (whole
    prompts, chunks, or recomputations over a cached prefix).

    A decode attends to the first ``len`` tokens of the blocks its table lists, in
    order: every listed block is full but the last, which holds the remainder. Dense
    decodes give one table per sequence, read by all its KV heads. Sparse attention
    (initial, selected and recent blocks per head) gives each KV head its own table and
    length instead, in ``decode_head_tables``/``decode_head_lens``: set together, they
    replace ``decode_block_tables``/``decode_seq_lens``, and the blocks are read in place.
    A dense table is the per-head table broadcast over heads, so the two give bit-equal
    results when every head lists every block.
    """

    slot_mapping: torch.Tensor          # [T] int64 flat KV slot of every token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor   # [D, max_blocks] int64
    decode_seq_lens: torch.Tensor       # [D] int64, context length incl. the new token
    prefills: list[PrefillSegment]
    block_size: int
    decode_head_tables: torch.Tensor | None = None  # [D, KVH, W] int64
    decode_head_lens: torch.Tensor | None = None    # [D, KVH] int64

    def __post_init__(self) -> None:
        if (self.decode_head_tables is None) != (self.decode_head_lens is None):
            raise ValueError("decode_head_tables and decode_head_lens: set both or neither")


class Ops(Protocol):
    name: str
    kv_layout: str   # the pool layout this backend's KV ops read and write (kv_layout.py)
    int8_kv: bool   # whether write_kv and attention handle an int8 pool (kvcache/kv_quant.py)

    def allocate_kv(self, shape: KVShape, num_blocks: int,
                    device: torch.device) -> list[torch.Tensor]:
        """The pool's per-layer KV tensors, zeroed, in ``shape.layout``."""
        ...

    def pack_linear(self, weight: torch.Tensor | Int8Weight,
                    quantization: str = "none") -> torch.Tensor | Int8Weight:
        """``weight`` [out, in] in the layout ``linear`` reads fastest, made once at load
        time; the result may be opaque to everything but ``linear``. ``quantization``
        ``w8a8``/``w8a16`` makes it int8 and ``fp16`` an fp32 weight fp16 (see
        ``quant_linear``); an ``Int8Weight`` (a pre-quantized checkpoint) is taken as it is."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for ``weight`` from ``pack_linear`` of W."""
        ...

    def fuse_decode(self, layers: Sequence[LayerWeights], final_norm: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int,
                    eps: float) -> FusedDecode | None:
        """Made once at load: one call for a decode-only step's whole layer loop, where
        this backend has one for these weights (``fused_decode``); None, and the model
        runs the loop op by op."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the next norm: ``(h + delta, rms_norm(h + delta))``; ``h``
        may be updated in place."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP's activation: ``silu(x[..., :I]) * x[..., I:]`` for x [..., 2I]."""
        ...

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor | Int8Weight,
            down: torch.Tensor | Int8Weight) -> torch.Tensor:
        """The gated MLP, ``linear(silu_and_mul(linear(x, gate_up)), down)``, whole so
        that a backend may fuse across its products (W8A8's rescale, activation and
        requantization in one pass)."""
        ...

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, H, D] and ``k`` [T, KVH, D] (neox halves) by their positions;
        ``cos``/``sin`` are [max_pos, D/2] tables. May rotate ``q`` and ``k`` in place."""
        ...

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of ``q`` [T, H, D] over each sequence's paged context
        (its new ``k``/``v`` [T, KVH, D] already written); returns [T, H, D]."""
        ...

    def block_selector(self, kind: str) -> BlockSelector:
        """Sparse attention's exact top-k block selection for ``kind`` summaries
        (``kvcache.block_summary``), run where this backend runs it fastest."""
        ...

    def copy_kv_blocks(self, src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor,
                       dst_ids: torch.Tensor, head: int | None = None) -> None:
        """``kvcache.host_tier.copy_kv_blocks``: offload mode's moves of a sequence's middle
        blocks into the host tier, and its recalls of a layer and KV head's selected
        blocks back into the pool."""
        ...
