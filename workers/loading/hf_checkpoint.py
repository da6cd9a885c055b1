"""Reading an HF checkpoint directory: config, safetensors weights, tokenizer files.

Weights are checked against the names and shapes the config implies, so a checkpoint
that does not fit the model fails here with the offending names instead of deep inside
a forward pass.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from workers.loading.compressed_tensors import Int8Layout, unpack_int8
from workers.model_config import ModelArchConfig

logger = logging.getLogger(__name__)

_EXPECTED_FILES = ("config.json, model.safetensors or model.safetensors.index.json (+ shards), "
                   "tokenizer.json")


def read_hf_config(directory: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``config.json`` and, when present, ``generation_config.json``."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file} not found: an HF checkpoint directory needs {_EXPECTED_FILES}")
    generation_file = directory / "generation_config.json"
    generation = _read_json(generation_file) if generation_file.is_file() else None
    return _read_json(config_file), generation


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the weights, in a stable order."""
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file} has no weight_map")
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(s) for s in shards if not s.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_file} names shards that are missing: "
                                    f"{', '.join(missing)}")
        return shards
    hint = ""
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        hint = ("; only safetensors weights are read: convert the .bin/.pt files with "
                "transformers (model.save_pretrained(dir, safe_serialization=True))")
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {directory}: an HF "
        f"checkpoint directory needs {_EXPECTED_FILES}{hint}")


def expected_weight_shapes(config: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the decoder described by ``config`` needs, with its shape."""
    hidden, inter, head = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden),
              "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q, hidden),
            layer + "self_attn.k_proj.weight": (kv, hidden),
            layer + "self_attn.v_proj.weight": (kv, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.qkv_bias:
            shapes |= {layer + "self_attn.q_proj.bias": (q,),
                       layer + "self_attn.k_proj.bias": (kv,),
                       layer + "self_attn.v_proj.bias": (kv,)}
        if config.o_bias:
            shapes[layer + "self_attn.o_proj.bias"] = (hidden,)
        if config.qk_norm:
            shapes |= {layer + "self_attn.q_norm.weight": (head,),
                       layer + "self_attn.k_norm.weight": (head,)}
    return shapes


def load_weights(files: list[Path], config: ModelArchConfig, dtype: torch.dtype,
                 int8: Int8Layout | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The parameters the model needs, in ``dtype``, and how each int8 weight runs
    (``w8a8`` or ``w8a16``, by name); extra tensors (a tied ``lm_head``, rotary caches)
    are dropped, missing or misshapen ones are an error.

    ``int8`` (an int8 checkpoint, see ``compressed_tensors``): the decoder layers' linear
    weights in its groups stay int8, with their ``weight_scale`` (packed ones unpacked)."""
    expected = expected_weight_shapes(config)
    groups = {} if int8 is None else {
        n: g for n in expected if n.startswith("model.layers.") and n.endswith("_proj.weight")
        and (g := int8.group_of(n)) is not None}
    packed = {}   # weight_packed name -> (weight name, input columns)
    for n, g in groups.items():
        out, inp = expected[n]
        if g.group_size is not None and inp % g.group_size:
            raise ValueError(f"{n}: {inp} input columns in groups of {g.group_size}; "
                             "the group size must divide the width")
        module = n.removesuffix("weight")
        expected[module + "weight_scale"] = (out, 1 if g.group_size is None
                                             else inp // g.group_size)
        if g.packed:
            packed[module + "weight_packed"] = (n, inp)
            expected[module + "weight_packed"] = (out, -(-inp // 4))
            del expected[n]
    weights: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name not in expected:
                if not name.endswith(".weight_shape"):   # a packed weight's, implied here
                    ignored.append(name)
                continue
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            weights[name] = tensor
    where = files[0].parent
    if ignored:
        logger.info("%s: ignoring %d tensors the model does not use: %s", where, len(ignored),
                    ", ".join(sorted(ignored)[:5]))
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise ValueError(f"{where}: {len(missing)} weights needed by {config.architecture} are "
                         f"missing, e.g. {', '.join(missing[:5])}")
    wrong = [f"{n} {tuple(t.shape)} (expected {expected[n]})" for n, t in weights.items()
             if tuple(t.shape) != expected[n] and not (n.endswith("weight_scale")
                                                      and tuple(t.shape) == expected[n][:1]
                                                      and expected[n][1] == 1)]
    want = {n: torch.int32 for n in packed} | dict.fromkeys(groups, torch.int8)
    wrong += [f"{n} {t.dtype} (expected {want.get(n, 'a float dtype')})"
              for n, t in weights.items() if want.get(n, t.dtype if t.is_floating_point()
                                                      else None) != t.dtype]
    if wrong:
        raise ValueError(f"{where}: weights do not match config.json: {'; '.join(wrong[:5])}")
    for name, (weight, columns) in packed.items():
        weights[weight] = unpack_int8(weights.pop(name), columns)
    return weights, {n: g.scheme for n, g in groups.items()}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
