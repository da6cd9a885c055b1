"""Shared fixtures: tiny random HF checkpoints (the arithmetic oracle) and helpers."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from workers.ops.linear_choice import CHOICES_ENV

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# The suite's linear-layer choices go to a folder of its own (``default_store``), named
# here, before any test module is collected: some build their ops at import, and Ray's
# workers inherit the environment. The folder goes when the session ends.
_LINEAR_CHOICES = tempfile.TemporaryDirectory(prefix="llm-cluster-test-choices-")
os.environ[CHOICES_ENV] = _LINEAR_CHOICES.name

# Property tests draw the same examples on every run: a failure seen once is seen again,
# and CI never fails on an example no earlier run drew.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


@dataclass
class TinyModel:
    path: str
    hf: torch.nn.Module  # the transformers model, fp32, eval mode: the oracle


def _hf_config(arch: str, max_positions: int | None = None, vocab_size: int | None = None):
    import transformers as tf

    tiny = TINY if max_positions is None else {**TINY, "max_position_embeddings": max_positions}
    if vocab_size is not None:
        tiny = {**tiny, "vocab_size": vocab_size}
    if arch == "llama":
        return tf.LlamaConfig(**tiny, tie_word_embeddings=False)
    if arch == "llama3-rope":
        return tf.LlamaConfig(**tiny, tie_word_embeddings=True, rope_theta=50000.0,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return tf.Qwen2Config(**tiny, tie_word_embeddings=False, rope_theta=1e6)
    if arch == "qwen3":
        return tf.Qwen3Config(**tiny, head_dim=32, tie_word_embeddings=True)
    if arch == "pangu":
        return tf.LlamaConfig(**tiny, attention_bias=True, tie_word_embeddings=False,
                              rope_theta=16e6)
    raise ValueError(arch)


def build_tiny(arch: str, directory: Path, seed: int = 0,
               max_positions: int | None = None, vocab_size: int | None = None) -> TinyModel:
    """A random checkpoint of ``arch`` saved as an HF directory, and its HF model.

    ``pangu`` is saved with openPangu-Embedded's config keys (``bias``) but its oracle
    is HF Llama with ``attention_bias``: the same arithmetic.
    """
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _hf_config(arch, max_positions, vocab_size)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger biases than the init gives, so they matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory, max_shard_size="200KB")
    if arch == "pangu":
        cfg_path = directory / "config.json"
        data = json.loads(cfg_path.read_text())
        data.pop("attention_bias", None)
        data.update(architectures=["PanguEmbeddedForCausalLM"], model_type="PanguEmbedded",
                    bias=True)
        cfg_path.write_text(json.dumps(data))
    return TinyModel(str(directory), model)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    cache: dict[str, TinyModel] = {}

    def get(arch: str) -> TinyModel:
        if arch not in cache:
            cache[arch] = build_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_long_factory(tmp_path_factory):
    """Tiny checkpoints with a 2048-token window, for long-context tests."""
    cache: dict[str, TinyModel] = {}

    def get(arch: str) -> TinyModel:
        if arch not in cache:
            cache[arch] = build_tiny(arch, tmp_path_factory.mktemp(f"tiny-long-{arch}"),
                                     max_positions=2048)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from workers.loading import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def tiny_builder():
    """``build_tiny`` itself, for a test that needs a checkpoint of its own shape (e.g. a
    vocabulary that fits a tokenizer it writes)."""
    return build_tiny
