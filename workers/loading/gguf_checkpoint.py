"""A GGUF file converted once into an HF-style checkpoint directory in the cache.

Parsing a GGUF (``GGUFReader`` walks every metadata value) and dequantizing it take
seconds, so the first load writes the result as an ordinary HF checkpoint (config.json,
model.safetensors in float32, which holds every dequantized value exactly,
tokenizer.json and tokenizer_config.json) and every later load reads that directory
like any HF checkpoint, memory-mapped. The directory is named by the GGUF's absolute
path, size, mtime and ``FORMAT_VERSION``, so a changed file or a change to this
conversion gets a fresh one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from workers.loading.gguf_tokenizer import check_gguf_tokenizer, convert_gguf_tokenizer
from workers.model_config import ModelArchConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Files of a converted directory other than meta.json, which is written last.
_WEIGHTS_FILE = "model.safetensors"
_META_FILE = "meta.json"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class ConvertedGGUF:
    """Where a GGUF's conversion lives, and why it has no tokenizer if it has none."""

    directory: Path
    tokenizer_error: str | None


def converted_dir(gguf_path: Path, cache_root: Path, *, require_tokenizer: bool,
                  rebuild: bool = False) -> ConvertedGGUF:
    """The cached conversion of ``gguf_path``, converting it first if needed.

    ``require_tokenizer``: fail before any tensor is dequantized when the file's
    tokenizer cannot be rebuilt (the caller has no other tokenizer to use).
    ``rebuild``: discard an existing conversion (it turned out unreadable).
    """
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = {"gguf": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
           "format": FORMAT_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    directory = cache_root / "gguf" / digest
    meta = None if rebuild else _read_valid_meta(directory, key)
    if meta is None:
        if directory.exists():
            logger.warning("discarding unusable GGUF conversion cache %s", directory)
            shutil.rmtree(directory, ignore_errors=True)
        meta = _convert(gguf_path, directory, key, require_tokenizer)
    else:
        logger.info("loading %s from its cached conversion %s", gguf_path, directory)
    error = meta.get("tokenizer_error")
    if error and require_tokenizer:
        raise ValueError(f"{gguf_path}: {error}")
    return ConvertedGGUF(directory, error)


def gguf_config(meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]
                ) -> dict[str, Any]:
    """An HF ``config.json`` dictionary for a GGUF's metadata and tensors."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported GGUF "
                         f"architectures: {', '.join(GGUF_ARCHITECTURES)}")

    def field(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    def required(name: str) -> int:
        value = field(name)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}; the file is incomplete")
        return int(value)

    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF has no token_embd.weight tensor; the file is incomplete")
    hidden = required("embedding_length")
    heads = required("attention.head_count")
    head_dim = int(field("attention.key_length", hidden // heads))
    rotary_dim = field("rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        raise ValueError(f"GGUF rope.dimension_count {rotary_dim} != head size {head_dim}: "
                         f"partial rotary embeddings are not supported")
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    scaling = field("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(field("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                field("rope.scaling.original_context_length", field("context_length", 2048))),
        }
    return config


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors HF models do not have."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if gguf_name == "rope_freqs.weight":
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart in the supported "
                     f"architectures ({', '.join(GGUF_ARCHITECTURES)})")


def unpermute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head reordering of Q/K rows (interleaved -> half-split RoPE).

    The converter stored ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``, with
    ``d`` the rows per head; this is its inverse.
    """
    rows = weight.shape[0]
    return (weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape).contiguous())


def _convert(gguf_path: Path, directory: Path, key: dict[str, Any],
             require_tokenizer: bool) -> dict[str, Any]:
    logger.info("converting %s (first load; later loads use the cache in %s)",
                gguf_path, directory)
    reader = GGUFReader(gguf_path)
    meta = {name: f.contents() for name, f in reader.fields.items()
            if not name.startswith("GGUF.")}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    config = gguf_config(meta, shapes)
    arch_config = ModelArchConfig.from_hf_config(config)
    tokenizer_error = check_gguf_tokenizer(meta)
    if tokenizer_error and require_tokenizer:
        raise ValueError(f"{gguf_path}: {tokenizer_error}")
    tokenizer = None if tokenizer_error else convert_gguf_tokenizer(meta)
    if "rope_freqs.weight" in shapes:
        logger.warning("%s has per-dimension RoPE factors (rope_freqs.weight), which are not "
                       "applied; long-context outputs may differ from llama.cpp", gguf_path)
    weights = _convert_tensors(reader, arch_config, permute_qk=meta["general.architecture"]
                               == "llama")

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        _write_json(staging / "config.json", config)
        save_file(weights, str(staging / _WEIGHTS_FILE), metadata={"format": "pt"})
        del weights
        if tokenizer is not None:
            (staging / "tokenizer.json").write_text(tokenizer.tokenizer_json, encoding="utf-8")
            _write_json(staging / "tokenizer_config.json", tokenizer.tokenizer_config)
        sizes = {p.name: p.stat().st_size for p in staging.iterdir()}
        meta_out = {"key": key, "file_sizes": sizes, "tokenizer_error": tokenizer_error}
        _write_json(staging / _META_FILE, meta_out)
        try:
            staging.rename(directory)
        except OSError:  # another process finished the same conversion first
            if _read_valid_meta(directory, key) is None:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta_out


def _convert_tensors(reader: GGUFReader, config: ModelArchConfig, *,
                     permute_qk: bool) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name."""
    heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if not array.flags.writeable or array.dtype != np.float32:
            array = array.astype(np.float32)  # copies out of the read-only file mapping
        weight = torch.from_numpy(array)
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]  # e.g. "self_attn.q_proj"
        if permute_qk and module in heads:
            weight = unpermute_rows(weight, heads[module])
        weights[name] = weight
    return weights


def _read_valid_meta(directory: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The conversion's meta.json if it is complete and belongs to ``key``, else None."""
    try:
        meta = json.loads((directory / _META_FILE).read_text(encoding="utf-8"))
        if meta.get("key") != key:
            return None
        for name, size in meta["file_sizes"].items():
            if (directory / name).stat().st_size != size:
                return None
        return meta
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False), encoding="utf-8")
