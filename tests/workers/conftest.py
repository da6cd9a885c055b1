"""Fixtures for the loading and tokenizer tests.

Oracles: HF transformers loading the same GGUF file (tokenizer, weights, chat template),
and tiny GGUF files written here with ``gguf.GGUFWriter`` from tiny random HF models
(``tiny_factory`` in tests/conftest.py), with a tiny byte-level BPE vocabulary.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from workers.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# HF parameter name suffix -> GGUF tensor name suffix, written independently of the
# loader's own table so that a wrong mapping there shows up as a mismatch.
_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def tiny_tokenizer_meta(pre: str = "gpt2", model: str = "gpt2") -> dict[str, Any]:
    """GGUF tokenizer metadata: 3 control tokens, the 256 byte symbols, a few merges and
    one user-defined token, enough to exercise splitting, merging and special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "12 3", "Ġ w", "o r",
              "Ġw or", "l d", "Ġwor ld", "' s", "Ġ 1"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = control + alphabet + merged + ["<think>"]
    types = [3] * len(control) + [1] * (len(alphabet) + len(merged)) + [4]
    return {
        "tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (what the loader must undo)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path: Path, hf_model: torch.nn.Module, arch: str,
                    tokenizer_meta: dict[str, Any] | None) -> Path:
    """``hf_model`` as an F32 GGUF of llama.cpp architecture ``arch``."""
    cfg = hf_model.config
    cfg_dict = cfg.to_dict()
    head_dim = cfg_dict.get("head_dim") or cfg.hidden_size // cfg.num_attention_heads
    rope_theta = cfg_dict.get("rope_theta") or cfg_dict["rope_parameters"]["rope_theta"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if tokenizer_meta is not None:
        writer.add_tokenizer_model(tokenizer_meta["tokenizer.ggml.model"])
        writer.add_tokenizer_pre(tokenizer_meta["tokenizer.ggml.pre"])
        writer.add_token_list(tokenizer_meta["tokenizer.ggml.tokens"])
        writer.add_token_types(tokenizer_meta["tokenizer.ggml.token_type"])
        writer.add_token_merges(tokenizer_meta["tokenizer.ggml.merges"])
        writer.add_bos_token_id(tokenizer_meta["tokenizer.ggml.bos_token_id"])
        writer.add_eos_token_id(tokenizer_meta["tokenizer.ggml.eos_token_id"])
        writer.add_unk_token_id(tokenizer_meta["tokenizer.ggml.unknown_token_id"])
        writer.add_pad_token_id(tokenizer_meta["tokenizer.ggml.padding_token_id"])
        writer.add_add_bos_token(tokenizer_meta["tokenizer.ggml.add_bos_token"])
        writer.add_chat_template(tokenizer_meta["tokenizer.chat_template"])
    tied = cfg.tie_word_embeddings
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        array = tensor.detach().float().numpy().copy()
        if name in _GLOBALS:
            gguf_name = _GLOBALS[name]
        else:
            _, _, layer, suffix = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_HF_TO_GGUF[suffix]}"
        if arch == "llama" and "q_proj" in name:
            array = permute_rows(array, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj" in name:
            array = permute_rows(array, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(name="tiny_tokenizer_meta")
def tiny_tokenizer_meta_fixture() -> Callable[..., dict[str, Any]]:
    return tiny_tokenizer_meta


@pytest.fixture
def tiny_tokenizer(tmp_path) -> Callable[..., Tokenizer]:
    """``make(pre="gpt2", extra_files=None, **tokenizer_config)``: the tiny vocabulary
    converted by us and loaded back as an HF tokenizer directory."""
    from workers.loading.gguf_tokenizer import convert_gguf_tokenizer

    made = itertools.count()

    def make(pre: str = "gpt2", extra_files: dict[str, str] | None = None,
             **config: Any) -> Tokenizer:
        directory = tmp_path / f"tokenizer-{next(made)}"
        directory.mkdir()
        for name, text in (extra_files or {}).items():
            (directory / name).write_text(text)
        files = convert_gguf_tokenizer(tiny_tokenizer_meta(pre))
        (directory / "tokenizer.json").write_text(files.tokenizer_json)
        (directory / "tokenizer_config.json").write_text(
            json.dumps({**files.tokenizer_config, **config}))
        return Tokenizer.from_hf_dir(directory)

    return make


@pytest.fixture
def tiny_gguf(tiny_factory, tmp_path) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """``make(arch, pre=..., tokenizer_model=..., gguf_arch=...)`` -> (GGUF path, HF model).

    ``tokenizer_model=None`` writes no tokenizer; ``gguf_arch`` overrides the
    architecture written into the file.
    """

    def make(arch: str, pre: str = "gpt2", tokenizer_model: str | None = "gpt2",
             name: str = "tiny.gguf", gguf_arch: str | None = None
             ) -> tuple[Path, torch.nn.Module]:
        hf = tiny_factory(arch).hf
        meta = tiny_tokenizer_meta(pre, tokenizer_model) if tokenizer_model else None
        return write_tiny_gguf(tmp_path / name, hf, gguf_arch or arch, meta), hf

    return make


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A private conversion cache for tests that look at cache behaviour."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LLM_CLUSTER_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llm-cluster-cache")


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path, session_cache):
    """Our load of the default GGUF (converted once into the session's cache)."""
    from workers.loading import load_checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_CLUSTER_CACHE", str(session_cache))
        return load_checkpoint(default_model_path)


@pytest.fixture(scope="session")
def smollm_tokenizer(default_checkpoint):
    return default_checkpoint.tokenizer


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_model_path):
    from transformers import AutoTokenizer

    path = Path(default_model_path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_gguf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture
def fake_npu(monkeypatch):
    """``install(soc=..., free_bytes=..., without=...)``: a fake torch_npu and torch.npu
    for this test (tests/workers/fake_torch_npu.py); returns its recorded state."""
    from tests.workers.fake_torch_npu import install
    from workers import device

    yield lambda **kw: install(monkeypatch, **kw)
    device.npu_available.cache_clear()
