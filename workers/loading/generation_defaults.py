"""A checkpoint's recommended sampling settings, as vLLM's ``--generation-config auto``.

HF checkpoints ship ``generation_config.json``; its sampling fields are what the model's
authors evaluated with, so they are the defaults for requests that leave those fields
out (OpenAI's own default, temperature 1.0, is far too hot for a small model). The
embedded default model is a GGUF file without that file; its model card's
recommendation stands in for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The generation-config fields that are sampling settings, with the type each takes.
SAMPLING_DEFAULT_FIELDS: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float,
    "repetition_penalty": float}

# SmolLM2-135M-Instruct's model card: "temperature=0.2, top_p=0.9".
EMBEDDED_MODEL_SAMPLING: dict[str, float | int] = {"temperature": 0.2, "top_p": 0.9}


def sampling_from_generation_config(generation: dict[str, Any] | None
                                    ) -> dict[str, float | int]:
    """The sampling fields a ``generation_config.json`` dictionary sets (others ignored)."""
    out: dict[str, float | int] = {}
    for name, kind in SAMPLING_DEFAULT_FIELDS.items():
        value = (generation or {}).get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = kind(value)
    return out


def model_sampling_defaults(model_path: str | None) -> dict[str, float | int]:
    """The defaults of ``model_path`` (None: the embedded model) without loading weights:
    its ``generation_config.json``; a GGUF file has none, except the embedded model."""
    if model_path is None:
        return dict(EMBEDDED_MODEL_SAMPLING)
    path = Path(model_path).expanduser()
    generation_file = path / "generation_config.json"
    if not path.is_dir() or not generation_file.is_file():
        return {}
    try:
        generation = json.loads(generation_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{generation_file} is not valid JSON: {e}") from e
    return sampling_from_generation_config(generation if isinstance(generation, dict) else None)


def resolve_sampling_defaults(model_path: str | None, generation_config: str,
                              configured: dict[str, Any]) -> dict[str, float | int]:
    """What requests that omit a field get. ``generation_config`` as vLLM's flag: ``auto``
    the model's defaults, ``vllm`` none (vLLM's own), or a directory holding a
    ``generation_config.json``; ``configured`` (``serving.default_sampling``, its names
    checked by the config) overrides."""
    if generation_config == "vllm":
        merged = {}
    elif generation_config == "auto":
        merged = model_sampling_defaults(model_path)
    elif (Path(generation_config).expanduser() / "generation_config.json").is_file():
        merged = model_sampling_defaults(generation_config)
    else:
        raise ValueError(f"generation_config: got {generation_config!r}; expected auto, vllm "
                         "or a directory holding a generation_config.json")
    for name, value in configured.items():
        merged[name] = SAMPLING_DEFAULT_FIELDS[name](value)
    return merged
