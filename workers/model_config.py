"""The shape of a Llama-family decoder, read from an HF ``config.json`` dictionary.

Every supported architecture is the same decoder with a few switches (biases, q/k
norm, head size, tied embeddings, RoPE scaling); this module turns a checkpoint's
config into those switches, and refuses anything else with the list of what works.
GGUF files are converted to the same dictionary by the GGUF loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchFlags:
    """What distinguishes one supported architecture from plain Llama."""

    bias_field: str | None = "attention_bias"  # config field switching q/k/v/o biases
    qkv_bias: bool = False  # q/k/v biases whatever the config says
    qk_norm: bool = False


SUPPORTED_ARCHITECTURES: dict[str, ArchFlags] = {
    "LlamaForCausalLM": ArchFlags(),
    "MistralForCausalLM": ArchFlags(bias_field=None),
    "Qwen2ForCausalLM": ArchFlags(bias_field=None, qkv_bias=True),
    "Qwen3ForCausalLM": ArchFlags(qk_norm=True),
    "PanguEmbeddedForCausalLM": ArchFlags(bias_field="bias"),
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any],
                       generation_config: dict[str, Any] | None = None) -> ModelArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        flags = SUPPORTED_ARCHITECTURES[arch]
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        shared_bias = bool(cfg.get(flags.bias_field, False)) if flags.bias_field else False
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        eos = _as_ids(cfg.get("eos_token_id"))
        if generation_config:
            eos += [t for t in _as_ids(generation_config.get("eos_token_id")) if t not in eos]
        max_pos = int(cfg.get("max_position_embeddings") or 2048)
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", True) and int(window) < max_pos:
            # Sliding-window attention is not implemented: stay inside the window,
            # where full attention is exact.
            max_pos = int(window)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=flags.qkv_bias or shared_bias,
            o_bias=shared_bias,
            qk_norm=flags.qk_norm,
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position=int(
                rope.get("original_max_position_embeddings", 8192)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos),
        )

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
