"""Sampling defaults from the model (vLLM's ``--generation-config auto``) and the config."""

from __future__ import annotations

import json
import shutil

import pytest

from cluster.config import ConfigError, config_from_dict, sampling_defaults
from scheduler.protocol import SamplingParams


@pytest.fixture
def checkpoint_with_generation_config(tiny_factory, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_factory("llama").path, path)
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "max_new_tokens": 99,
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}))
    return str(path)


def _config(path, **sections):
    return config_from_dict({"model": {"path": path, **sections.pop("model", {})}, **sections})


def test_generation_config_sampling_fields_are_the_defaults(checkpoint_with_generation_config):
    got = sampling_defaults(_config(checkpoint_with_generation_config))
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    assert isinstance(got["top_k"], int)


def test_config_overrides_the_model_and_vllm_mode_ignores_it(
        checkpoint_with_generation_config):
    path = checkpoint_with_generation_config
    over = sampling_defaults(_config(path, serving={"default_sampling": {"temperature": 0}}))
    assert over["temperature"] == 0.0 and over["top_p"] == 0.95
    assert sampling_defaults(_config(path, model={"generation_config": "vllm"})) == {}


def test_embedded_model_gets_its_model_card_recommendation():
    assert sampling_defaults(config_from_dict({})) == {"temperature": 0.2, "top_p": 0.9}


def test_llm_without_params_samples_with_the_model_defaults(checkpoint_with_generation_config):
    from cluster.llm import LLM

    llm = LLM(checkpoint_with_generation_config, kv_cache_bytes=8 << 20)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    prompt = {"prompt_token_ids": [1, 5, 6, 7]}
    assert len(llm.generate(prompt)[0].outputs[0].token_ids) == SamplingParams().max_tokens


@pytest.mark.parametrize("bad, words", [
    ({"serving": {"default_sampling": {"temprature": 0.1}}}, ["temprature", "temperature"]),
    ({"serving": {"default_sampling": {"top_p": 0.0}}}, ["default_sampling.top_p", "0.0"]),
    ({"model": {"generation_config": "/nowhere"}}, ["generation_config", "/nowhere"]),
])
def test_bad_settings_name_the_field(bad, words):
    with pytest.raises(ConfigError) as e:
        sampling_defaults(config_from_dict(bad))
    assert all(w in str(e.value) for w in words)
