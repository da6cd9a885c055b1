"""YAML configuration: defaults, overrides, and errors that name field and value."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, EngineConfig, load_config


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_empty_file_is_the_default(tmp_path):
    assert load_config(write(tmp_path, "")) == EngineConfig()
    assert load_config(None).model.path is None


def test_sections_override_fields(tmp_path):
    cfg = load_config(write(tmp_path, "cache:\n  block_size: 32\n  kv_cache_bytes: 1000000\n"
                                      "scheduler:\n  policy: priority\n  max_num_seqs: 8\n"))
    assert cfg.cache.block_size == 32 and cfg.scheduler.policy == "priority"
    assert cfg.scheduler.max_num_seqs == 8 and cfg.model.dtype == "float32"


@pytest.mark.parametrize("text,message", [
    ("cache:\n  block_size: 20\n", "cache.block_size: got 20; allowed: a multiple of 16"),
    ("cache:\n  block_size: '16'\n", "cache.block_size: got '16'; expected int"),
    ("cache:\n  blocksize: 16\n", "cache: unknown field(s) 'blocksize'; allowed: block_size"),
    ("scheduler:\n  policy: lifo\n", "scheduler.policy: got 'lifo'; allowed: fcfs, priority"),
    ("model:\n  device: tpu\n", "model.device: got 'tpu'; allowed: auto, cpu, cuda, npu"),
    ("model:\n  dtype: int4\n", "model.dtype: got 'int4'"),
    ("models: {}\n", "unknown field(s) 'models'"),
    ("cache: 5\n", "cache: got 5; expected a mapping"),
    ("scheduler:\n  max_num_seqs: 0\n", "scheduler.max_num_seqs: got 0"),
])
def test_errors_name_field_value_and_allowed(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "cache: [unclosed\n"))


def test_cluster_section_and_presets():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "cpu-1p1d.yaml")
    assert [(p.role, p.count, p.resources, p.threads) for p in cfg.cluster.pools] == \
        [("prefill", 1, {"CPU": 1.0}, 1), ("decode", 1, {"CPU": 1.0}, 1)]
    assert cfg.cluster.prefill_threshold == 32
    mixed = load_config(root / "configs" / "cpu-mixed.yaml")
    assert [(p.role, p.threads) for p in mixed.cluster.pools] == [("mixed", 2)]
    assert EngineConfig().cluster.pools == []   # no pools: the one-process engine


@pytest.mark.parametrize("text,message", [
    ("cluster:\n  pools: [{role: verify}]\n",
     "cluster.pools[0].role: got 'verify'; allowed: prefill, decode, mixed"),
    ("cluster:\n  pools: [{role: decode, count: 0}]\n", "cluster.pools[0].count: got 0"),
    ("cluster:\n  pools: [{resources: {NPU: 0}}]\n",
     "cluster.pools[0].resources: got NPU: 0.0; amounts must be > 0"),
    ("cluster:\n  pools: [{resources: {CPU: many}}]\n",
     "cluster.pools[0].resources.CPU: got 'many'; expected float"),
    ("cluster:\n  pools: {role: decode}\n", "cluster.pools: got {'role': 'decode'}; "
                                           "expected a list"),
    ("cluster:\n  max_waiting: 0\n", "cluster.max_waiting: got 0; expected >= 1"),
    ("cluster:\n  name: 'a b'\n", "cluster.name: got 'a b'"),
])
def test_cluster_errors_name_field_value_and_allowed(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert message in str(e.value)


def test_long_context_from_the_reference_design_variables(tmp_path, monkeypatch, caplog):
    """VLLM_RETRIEVAL_* fill the fields the file leaves out; the file wins; each value's
    source is logged."""
    monkeypatch.setenv("VLLM_RETRIEVAL_TOPK_PERCENT", "0.3")
    monkeypatch.setenv("VLLM_RETRIEVAL_DENSE_BOUNDARY", "40960")
    monkeypatch.setenv("VLLM_RETRIEVAL_LOCAL_TOKENS_NUM", "4096")
    with caplog.at_level("INFO", logger="kvcache.long_context"):
        cfg = load_config(write(tmp_path, "long_context:\n  enabled: true\n"
                                          "  local_tokens: 2048\n"))
    lc = cfg.long_context
    assert (lc.top_k_percent, lc.dense_boundary, lc.local_tokens) == (0.3, 40960, 2048)
    assert lc.initial_tokens == 1024   # neither file nor environment: the default
    assert "long_context.top_k_percent = 0.3 (environment (VLLM_RETRIEVAL_TOPK_PERCENT))" \
        in caplog.text
    assert "long_context.local_tokens = 2048 (config file)" in caplog.text
    assert "long_context.initial_tokens = 1024 (default)" in caplog.text
    monkeypatch.setenv("VLLM_RETRIEVAL_DENSE_BOUNDARY", "lots")
    with pytest.raises(ConfigError, match="VLLM_RETRIEVAL_DENSE_BOUNDARY: got 'lots'"):
        load_config(None)


@pytest.mark.parametrize("text,message", [
    ("long_context:\n  enabled: true\n  retrieval_block_size: 24\n",
     "long_context.retrieval_block_size: got 24; it must be a multiple of the pool's "
     "block_size 16"),
    ("long_context:\n  dense_boundary: 4096\n",
     "long_context.dense_boundary: got 4096; a sparse sequence needs room"),
    ("long_context:\n  offload_boundary: 1000\n",
     "long_context.offload_boundary: got 1000, below dense_boundary=32768"),
    ("long_context:\n  summary: max\n",
     "long_context.summary: got 'max'; allowed: mean, minmax, hybrid"),
])
def test_long_context_errors_name_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(write(tmp_path, text))
