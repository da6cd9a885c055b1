"""One Llama-family decoder covering every supported architecture.

The switches in ``ModelArchConfig`` (attention biases, per-head q/k RMSNorm, head
size, tied embeddings, RoPE scaling) are the only differences between Llama,
SmolLM2, Mistral, Qwen2/2.5, Qwen3 and openPangu-Embedded. Q, K and V projections
are fused into one matrix and gate/up into another, so a layer is four matmuls.
Attention, KV writes, norms and rotary go through the ops seam.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from workers.model_config import ModelArchConfig
from workers.ops.base import AttentionMetadata, Ops
from workers.ops.quant_linear import Int8Weight, head_quantization

# A decoder layer's fused linear layers, each one product over these HF modules.
FUSED_MODULES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
                 "down": ("mlp.down_proj",)}

if TYPE_CHECKING:
    from workers.sparse_step import SparseStep


def rope_tables(cfg: ModelArchConfig, max_positions: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim/2] in fp32, with the configured scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64)
                                         .to(torch.float32) / dim))
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, cfg)
    pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(pos, inv_freq)
    return freqs.cos().to(device), freqs.sin().to(device)


def _llama3_scaled(inv_freq: torch.Tensor, cfg: ModelArchConfig) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones
    kept, and a smooth blend between the two thresholds."""
    factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, blended, scaled)


def _linear(ops: Ops, w: dict[str, torch.Tensor], names: list[str], quantization: str,
            int8_schemes: Mapping[str, str]) -> torch.Tensor | Int8Weight:
    """The named projections fused along their outputs, packed by the ops. Int8 weights
    (a pre-quantized checkpoint, with ``<name>.weight_scale`` per output channel or group
    of input columns) stay int8: they are used as stored, as the checkpoint says
    (``int8_schemes``, ``w8a8`` where it does not), and as ``w8a16`` when that is asked
    for."""
    weights = [w[n + ".weight"] for n in names]
    if weights[0].dtype != torch.int8:
        return ops.pack_linear(torch.cat(weights), quantization)
    stored = {int8_schemes.get(n + ".weight", "w8a8") for n in names}
    if len(stored) > 1:
        raise ValueError(f"{', '.join(names)}: int8 weights of schemes {sorted(stored)}, which "
                         "the engine computes as one product; quantize them alike")
    scheme = "w8a16" if quantization == "w8a16" else stored.pop()
    scales = torch.cat([w[n + ".weight_scale"].reshape(weights[i].shape[0], -1)
                        for i, n in enumerate(names)])
    return ops.pack_linear(Int8Weight.from_int8(scheme, torch.cat(weights), scales))


class DecoderLayer:
    """One layer's weights; the four matrices as ``ops.pack_linear`` lays them out
    (int8 under ``quantization``; norms stay in the compute dtype)."""

    def __init__(self, cfg: ModelArchConfig, w: dict[str, torch.Tensor], prefix: str,
                 ops: Ops, quantization: str = "none",
                 int8_schemes: Mapping[str, str] = MappingProxyType({})) -> None:
        a = prefix + "self_attn."

        def names(kind: str) -> list[str]:
            return [prefix + n for n in FUSED_MODULES[kind]]

        def linear(kind: str) -> torch.Tensor | Int8Weight:
            return _linear(ops, w, names(kind), quantization, int8_schemes)
        self.qkv_w = linear("qkv")
        self.qkv_b = (torch.cat([w[n + ".bias"] for n in names("qkv")]) if cfg.qkv_bias
                      else None)
        self.o_w = linear("o")
        self.o_b = w[a + "o_proj.bias"] if cfg.o_bias else None
        self.q_norm = w[a + "q_norm.weight"] if cfg.qk_norm else None
        self.k_norm = w[a + "k_norm.weight"] if cfg.qk_norm else None
        self.in_norm = w[prefix + "input_layernorm.weight"]
        self.post_norm = w[prefix + "post_attention_layernorm.weight"]
        self.gate_up_w = linear("gate_up")
        self.down_w = linear("down")


class DecoderLM:
    """``quantization`` (``w8a8``, ``w8a16``) makes the decoder layers' linear layers
    int8; the embedding stays in the compute dtype, the LM head as
    ``quant_linear.head_quantization`` says. ``int8_schemes``: how the int8 weights of a
    pre-quantized checkpoint run (``Checkpoint.int8_schemes``)."""

    def __init__(self, cfg: ModelArchConfig, weights: dict[str, torch.Tensor], ops: Ops,
                 max_positions: int, device: torch.device, dtype: torch.dtype,
                 quantization: str = "none",
                 int8_schemes: Mapping[str, str] = MappingProxyType({})) -> None:
        _check_weights(cfg, weights)
        w = {k: v.to(device=device, dtype=torch.float32 if k.endswith(".weight_scale")
                      else v.dtype if v.dtype == torch.int8 else dtype)
             for k, v in weights.items()}
        self.cfg = cfg
        self.ops = ops
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = ops.pack_linear(self.embed if cfg.tie_word_embeddings
                                       else w["lm_head.weight"], head_quantization(quantization))
        self.norm = w["model.norm.weight"]
        self.layers = [DecoderLayer(cfg, w, f"model.layers.{i}.", ops, quantization,
                                    int8_schemes) for i in range(cfg.num_layers)]
        self.fused_decode = ops.fuse_decode(self.layers, self.norm, cfg.num_heads,
                                            cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        cos, sin = rope_tables(cfg, max_positions, device)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self.scale = cfg.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                sparse: SparseStep | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of tokens.

        ``sparse`` (long contexts) refreshes block summaries after each layer's KV write
        and gives the layer's decodes their per-KV-head block tables."""
        cfg, ops = self.cfg, self.ops
        t = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        x = ops.rms_norm(h, self.layers[0].in_norm, cfg.rms_norm_eps)
        if (sparse is None and self.fused_decode is not None
                and self.fused_decode.runs(t, meta, kv_caches[0].dtype)):
            return self.fused_decode(h, x, positions, kv_caches, meta, self.cos, self.sin,
                                     self.scale)
        next_norms = [layer.in_norm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, kv_cache, next_norm) in enumerate(zip(self.layers, kv_caches,
                                                             next_norms)):
            qkv = ops.linear(x, layer.qkv_w, layer.qkv_b)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(t, cfg.num_heads, cfg.head_dim)
            k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = ops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q, k = ops.rotary(q, k, positions, self.cos, self.sin)
            ops.write_kv(k, v, kv_cache, meta.slot_mapping)
            layer_meta = meta
            if sparse is not None:  # its metadata: per-head tables when a decode is sparse
                sparse.after_write(i, kv_cache)
                layer_meta = sparse.decode_meta(i, q, kv_cache)
            o = ops.attention(q, k, v, kv_cache, layer_meta, self.scale)
            h, x = ops.add_rms_norm(h, ops.linear(o.reshape(t, cfg.q_size), layer.o_w, layer.o_b),
                                    layer.post_norm, cfg.rms_norm_eps)
            mlp = ops.mlp(x, layer.gate_up_w, layer.down_w)
            h, x = ops.add_rms_norm(h, mlp, next_norm, cfg.rms_norm_eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.lm_head).float()


def expected_weight_names(cfg: ModelArchConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {f"{p}self_attn.{n}_proj.weight" for n in "qkvo"}
        names |= {f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        if cfg.qkv_bias:
            names |= {f"{p}self_attn.{n}_proj.bias" for n in "qkv"}
        if cfg.o_bias:
            names.add(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


def _check_weights(cfg: ModelArchConfig, weights: dict[str, torch.Tensor]) -> None:
    missing = sorted(expected_weight_names(cfg) - weights.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint lacks {len(missing)} weights the {cfg.architecture} "
                         f"config needs: {shown}")
