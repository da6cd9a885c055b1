"""A decode-only step through every decoder layer in one C++ call on the CPU
(``csrc/decode_layers_cpu.cpp``), for w8a16 models whose linear layers run the packed
int8 kernel at the step's batch size.

Batch-1 decode of the default model spent about a quarter of its forward between
kernels: in the layer loop's Python and in torch.ops' parsing of each call's arguments
(benchmarks/RESULTS.md). The op calls the same kernels in the same order as the loop
with the CPU ops, so a step gives bit-equal hidden states either way. Every other step
(prefill chunks, sparse decodes, batches whose row count the chooser gave another
implementation, q/k norms, other weights) keeps the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from workers.ops.base import AttentionMetadata
from workers.ops.linear_choice import ChosenLinear, range_index
from workers.ops.packed_weights import PackedWeight

INT8_KERNEL = "int8-kernel"   # the chooser's name for the packed w8a16 kernel


class LayerWeights(Protocol):
    """What the fused step reads of a decoder layer (``models.decoder.DecoderLayer``)."""

    qkv_w: Any
    qkv_b: torch.Tensor | None
    o_w: Any
    o_b: torch.Tensor | None
    gate_up_w: Any
    down_w: Any
    q_norm: torch.Tensor | None
    in_norm: torch.Tensor
    post_norm: torch.Tensor


@dataclass(frozen=True)
class FusedDecode:
    """The flat arguments of ``decode_layers_w8a16`` for one model, made once at load.
    ``fits[i]``: whether row range ``i`` (from ``firsts``) runs the int8 kernel in every
    linear layer."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    out_features: list[int]
    firsts: tuple[int, ...]
    fits: tuple[bool, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    kv_dtypes: tuple[torch.dtype, ...]   # the pools the kernels write and read

    def runs(self, tokens: int, meta: AttentionMetadata, kv_dtype: torch.dtype) -> bool:
        """Whether this step is one the op computes: dense decodes only, into a pool the
        kernels take, at a batch size whose linear layers all run the int8 kernel."""
        return (meta.num_decode_tokens == tokens and not meta.prefills
                and meta.decode_head_tables is None and kv_dtype in self.kv_dtypes
                and self.fits[range_index(self.firsts, tokens)])

    def __call__(self, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                 kv_caches: Sequence[torch.Tensor], meta: AttentionMetadata,
                 cos: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
        """The final normed hidden states [T, hidden] of the layers' loop; ``h`` (the
        residual stream, [T, hidden]) is updated in place as the loop does."""
        return torch.ops.llm_cluster.decode_layers_w8a16(
            h, x, positions, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_seq_lens, self.weights, self.biases, list(kv_caches), cos, sin,
            self.out_features, self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
            scale)


def fuse_decode(layers: Sequence[LayerWeights], final_norm: torch.Tensor, num_heads: int,
                num_kv_heads: int, head_dim: int, eps: float,
                kv_dtypes: tuple[torch.dtype, ...]) -> FusedDecode | None:
    """The fused step for these layers, or None where no row range could use it (not
    w8a16 packed weights, fp weights, q/k norms, activations other than fp32)."""
    if not layers or layers[0].q_norm is not None or final_norm.dtype != torch.float32:
        return None
    linears = [[layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w] for layer in layers]
    if not all(isinstance(w, ChosenLinear) and w.choice.kind == "w8a16"
               for row in linears for w in row):
        return None
    ranges = linears[0][0].firsts
    fits = tuple(all(w.choice.names[i] == INT8_KERNEL for row in linears for w in row)
                 for i in range(len(ranges)))
    if not any(fits):
        return None
    i = fits.index(True)
    weights, biases = [], []
    next_norms = [layer.in_norm for layer in layers[1:]] + [final_norm]
    for layer, row, next_norm in zip(layers, linears, next_norms):
        for w in row:
            packed: PackedWeight = w.runs[i][1]
            weights += [packed.data, packed.scale]
        weights += [layer.post_norm, next_norm]
        biases += [layer.qkv_b, layer.o_b]
    out_features = [w.out_features for w in linears[0]]
    return FusedDecode(weights, biases, out_features, ranges, fits, num_heads, num_kv_heads,
                       head_dim, eps, kv_dtypes)
