"""SmoothQuant (Xiao et al., 2023) for ``w8a8``: per input channel j of a linear layer,
``x_j / s_j`` and ``W[:, j] * s_j`` give the same product, and with
``s_j = max|X_j|^ALPHA / max|W_j|^(1 - ALPHA)`` (activation maxima from
``calibration.py``) the few activation channels with large values, which dominate a
per-token int8 scale and crush the rest, are shrunk while the weights, quantized per
output channel, absorb the factor. On the default model it lifted w8a8's top-1
agreement with HF fp32 from 91.7% to about 95% (benchmarks/RESULTS.md).

The division by ``s`` is folded into the op that produces the input, so the run-time
arithmetic is unchanged: the input RMSNorm weight (QKV), the post-attention RMSNorm
weight (gate-up), up_proj's output rows (down_proj; SwiGLU is linear in up) and
v_proj's output rows and bias (o_proj; a query head reads its KV head's values, so the
heads of a group share one factor per channel, from the max over the group). The
result is a new fp checkpoint, quantized afterwards like any other: every device's
ops (CPU, CUDA, NPU) gets it without a kernel of its own.
"""

from __future__ import annotations

import logging

import torch

from workers.model_config import ModelArchConfig
from workers.models.calibration import LayerMaxima, activation_maxima, calibration_ids
from workers.models.decoder import FUSED_MODULES
from workers.tokenizer import Tokenizer

ALPHA = 0.6     # the migration strength: best of 0.5-0.85 on the default model (RESULTS.md)
_FLOOR = 1e-5   # a dead channel (max 0) gets a finite factor

log = logging.getLogger(__name__)


def smoothing_factors(act_max: torch.Tensor, weight: torch.Tensor,
                      alpha: float = ALPHA) -> torch.Tensor:
    """``s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha)`` for a weight [out, in], on
    the weight's device (the maxima may come from an accelerator)."""
    w_max = weight.float().abs().amax(0).clamp(min=_FLOOR)
    x_max = act_max.to(w_max.device, torch.float32).clamp(min=_FLOOR)
    return x_max.pow(alpha) / w_max.pow(1 - alpha)


def smooth_weights(cfg: ModelArchConfig, weights: dict[str, torch.Tensor],
                   maxima: list[LayerMaxima], alpha: float = ALPHA) -> dict[str, torch.Tensor]:
    """A copy of the fp checkpoint ``weights`` (HF names) with every decoder layer
    smoothed; the model it defines computes the same function in exact arithmetic."""
    out = dict(weights)

    def scale(name: str, factor: torch.Tensor, dim: int) -> None:
        """Multiply the weight ``name`` by ``factor`` along ``dim`` (-1: 1-D)."""
        w = out[name]
        f = factor.to(w.device) if dim < 0 else factor.to(w.device).unsqueeze(1 - dim)
        out[name] = (w.float() * f).to(w.dtype)

    group = cfg.num_heads // cfg.num_kv_heads
    for i, m in enumerate(maxima):
        p = f"model.layers.{i}."
        a, mlp = p + "self_attn.", p + "mlp."
        for norm, kind, act in ((p + "input_layernorm.weight", "qkv", m.qkv),
                                (p + "post_attention_layernorm.weight", "gate_up", m.gate_up)):
            names = [p + n for n in FUSED_MODULES[kind]]
            s = smoothing_factors(act, torch.cat([out[n + ".weight"] for n in names]), alpha)
            scale(norm, 1 / s, -1)
            for n in names:
                scale(n + ".weight", s, 1)
        s = smoothing_factors(m.down, out[mlp + "down_proj.weight"], alpha)
        scale(mlp + "up_proj.weight", 1 / s, 0)
        scale(mlp + "down_proj.weight", s, 1)
        s = _o_factors(cfg, group, m.o, out[a + "o_proj.weight"], alpha)
        scale(a + "v_proj.weight", 1 / s, 0)
        if cfg.qkv_bias:
            scale(a + "v_proj.bias", 1 / s, -1)
        scale(a + "o_proj.weight", _per_query_head(cfg, group, s), 1)
    return out


def _o_factors(cfg: ModelArchConfig, group: int, act_max: torch.Tensor, weight: torch.Tensor,
               alpha: float) -> torch.Tensor:
    """o_proj's factors per (KV head, channel), flat [kv_size]: its input channel
    (query head h, d) is value channel (h // group, d), so maxima are taken over groups."""
    def per_kv(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(cfg.num_kv_heads, group, cfg.head_dim).amax(1)

    w_max = per_kv(weight.float().abs().amax(0)).clamp(min=_FLOOR)
    a_max = per_kv(act_max.to(w_max.device, torch.float32)).clamp(min=_FLOOR)
    return (a_max.pow(alpha) / w_max.pow(1 - alpha)).reshape(-1)


def _per_query_head(cfg: ModelArchConfig, group: int, s: torch.Tensor) -> torch.Tensor:
    """[kv_size] factors repeated for each query head of a group: [q_size]."""
    return (s.reshape(cfg.num_kv_heads, 1, cfg.head_dim)
            .expand(-1, group, -1).reshape(-1))


def smooth_for_w8a8(cfg: ModelArchConfig, weights: dict[str, torch.Tensor],
                    tokenizer: Tokenizer | None, device: torch.device) -> dict[str, torch.Tensor]:
    """``weights`` smoothed with statistics of the calibration text, when w8a8 is about to
    quantize them; as given when they arrive int8 (already quantized by their maker) or
    when there is no tokenizer to read the text with (logged)."""
    if any(w.dtype == torch.int8 for w in weights.values()):
        return weights
    if tokenizer is None:
        log.warning("w8a8: the checkpoint has no tokenizer to read the calibration text "
                    "with; its linear layers are quantized without SmoothQuant")
        return weights
    maxima = activation_maxima(cfg, weights, calibration_ids(tokenizer), device)
    return smooth_weights(cfg, weights, maxima)
