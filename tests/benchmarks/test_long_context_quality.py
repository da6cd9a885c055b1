"""The quality benchmark's machinery on a tiny random checkpoint with the default model's
tokenizer: teacher forcing feeds the text whatever the model predicts; with every middle
block selected, sparse and offloaded decoding equal dense; with few selected they do
not (sparse attention is really in the path); the passkey prompts put the needle where
they say; ``--quick`` runs end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.long_context_quality import forced_figures, main
from benchmarks.long_context_tasks import (
    Regions,
    engine_config,
    passkey_cases,
    run_forced,
    window_starts,
)
from cluster import LLM
from workers.tokenizer import Tokenizer

WINDOW = 2048
TEXT_TOKENS = 1600
STARTS = [1100, 1400]   # past the 1024-token dense boundary: every forced decode is sparse
STEPS = 24
KV_BYTES = 16 << 20
HOST_BYTES = 16 << 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_path) -> str:
    """A random 2-layer Llama with a 2048-token window and the default model's tokenizer
    (so its vocabulary size)."""
    import transformers as tf

    from workers.loading.checkpoint import cache_root
    from workers.loading.gguf_checkpoint import converted_dir

    tok_dir = converted_dir(Path(default_model_path), cache_root(),
                            require_tokenizer=True).directory
    vocab = Tokenizer.from_hf_dir(str(tok_dir)).vocab_size
    directory = tmp_path_factory.mktemp("tiny-long-context")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=WINDOW, rms_norm_eps=1e-6,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=True)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, directory / name)
    return str(directory)


@pytest.fixture(scope="module")
def text() -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 1000, (TEXT_TOKENS,), generator=g).tolist()


def _forced(tiny_dir: str, variant: str, text: list[int], top_k_percent: float):
    llm = LLM(config=engine_config(variant, Regions(top_k_percent=top_k_percent),
                                   model=tiny_dir, kv_cache_bytes=KV_BYTES,
                                   host_kv_bytes=HOST_BYTES))
    steps = run_forced(llm, text, STARTS, STEPS, keep_logits=True)
    return steps, llm.engine.runner.long_context


@pytest.fixture(scope="module")
def dense_steps(tiny_dir, text):
    return _forced(tiny_dir, "dense", text, 0.2)[0]


def test_forcing_feeds_the_text(dense_steps, text):
    assert len(dense_steps) == len(STARTS) * STEPS
    for start in STARTS:
        rows = [s for s in dense_steps if s.start == start]
        assert [s.position for s in rows] == list(range(start, start + STEPS))
        assert [s.target for s in rows] == text[start:start + STEPS]
        for s in rows:  # the recorded choice is the greedy one of the row's logits
            assert s.argmax == int(s.logits.argmax())
    # A random model does not predict random text: the forcing really replaced tokens.
    assert sum(s.argmax != s.target for s in dense_steps) > STEPS


@pytest.mark.parametrize("variant", ["sparse", "offload"])
def test_all_blocks_selected_equals_dense(tiny_dir, text, dense_steps, variant):
    steps, lc = _forced(tiny_dir, variant, text, 1.0)
    figs = forced_figures(dense_steps, steps)
    assert figs["positions"] == len(STARTS) * (STEPS - 1)
    assert figs["agreement"] == 1.0
    dense = {(s.start, s.position): s.logits for s in dense_steps}
    for s in steps:
        torch.testing.assert_close(s.logits, dense[s.start, s.position], rtol=1e-5, atol=1e-4)
    assert lc.stats.selections > 0
    assert (lc.stats.offloaded_blocks > 0) == (variant == "offload")


@pytest.mark.parametrize("variant", ["sparse", "offload"])
def test_few_blocks_selected_still_follow_the_text(tiny_dir, text, dense_steps, variant):
    steps, lc = _forced(tiny_dir, variant, text, 0.05)   # one or two of 15..25 middle blocks
    assert [(s.start, s.position, s.target) for s in steps] == [
        (s.start, s.position, s.target) for s in dense_steps]
    figs = forced_figures(dense_steps, steps)
    assert figs["max_abs_logit_diff_max"] > 1e-3   # sparse attention changed the logits
    if variant == "offload":
        assert lc.stats.recalled_blocks > 0


def test_window_starts():
    assert window_starts(2000, 8000, 100, 4) == [2000, 3967, 5933, 7900]
    assert window_starts(1100, 1600, 8, 1) == [1100]
    with pytest.raises(ValueError):
        window_starts(1000, 1050, 100, 2)


def test_passkey_cases_place_the_needle(tiny_dir):
    tok = Tokenizer.from_hf_dir(tiny_dir)
    cases = passkey_cases(tok, [1280, 1792], [0.0, 0.5, 1.0], 0, Regions())
    assert len(cases) == 6 and len({c.passkey for c in cases}) == 6
    for c in cases:
        assert c.length - 40 < len(c.token_ids) <= c.length
        assert 10000 <= c.passkey <= 99999
        digits = tok.encode(str(c.passkey), add_special_tokens=False)
        assert c.token_ids[c.needle_at:c.needle_at + len(digits)] == digits
        assert abs(c.needle_at / len(c.token_ids) - c.depth) < 0.05
    assert [c.region for c in cases] == ["initial", "middle", "local"] * 2


def test_quick_run(tiny_dir, tmp_path):
    out = tmp_path / "quality.json"
    assert main(["--quick", "--model", tiny_dir, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["passkey"]) == {"dense", "sparse", "offload"}
    assert all(f["cases"] == 6 for f in data["passkey"].values())
    assert set(data["forced"]) == {"sparse", "offload"}
    assert all(f["positions"] == 2 * 7 for f in data["forced"].values())
    assert data["tier_stats"]["offload"]["offloaded_blocks"] > 0
    assert data["tier_stats"]["sparse"]["offloaded_blocks"] == 0
    assert data["tier_stats"]["sparse"]["selections"] > 0
    assert set(data["verdicts"]) == {"sparse", "offload"}
