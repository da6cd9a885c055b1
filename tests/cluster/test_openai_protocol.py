"""OpenAI request parsing and response pieces, without a server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.config import EngineConfig, config_from_dict, load_config, with_default_pools
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    parse_request,
)
from cluster.output_processor import streamable_text
from cluster.outputs import CompletionOutput, Logprob

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_completion_request_fields_and_sampling_params():
    req = parse_request(CompletionRequest, {
        "model": "m", "prompt": [[1, 2], [3]], "max_tokens": 5, "temperature": 0,
        "top_k": 4, "stop": "x", "seed": 10, "ignore_eos": True})
    assert req.prompts == [[1, 2], [3]]
    sp = req.sampling_params(5, None, 11)
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.stop, sp.seed, sp.ignore_eos) == \
        (5, 0.0, 4, ["x"], 11, True)
    assert parse_request(CompletionRequest, {"model": "m", "prompt": [7, 8]}).prompts == [[7, 8]]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi"}, "model"),
    ({"model": "m", "prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"model": "m", "prompt": "hi", "n": 1.5}, "n"),
    ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": {"text": "hi"}}, "prompt"),
])
def test_wrong_types_name_their_field(body, param):
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param


def test_out_of_range_sampling_values_are_400_naming_the_field():
    req = parse_request(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5})
    with pytest.raises(APIError) as e:
        req.sampling_params(8, None, None)
    assert e.value.param == "top_p" and "1.5" in e.value.message


def test_chat_messages_accept_text_parts_and_max_completion_tokens_wins():
    req = parse_request(ChatCompletionRequest, {
        "model": "m", "max_tokens": 3, "max_completion_tokens": 9,
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}]})
    assert [m.as_template_input() for m in req.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert req.output_limit == 9


def test_logprob_objects_from_an_output():
    out = CompletionOutput(0, "ab", [5, 6], logprobs=[
        {5: Logprob(-0.1, 1, "a"), 7: Logprob(-2.0, 2, "c")},
        {6: Logprob(-3.0, None, "b"), 8: Logprob(-0.5, 1, "d")}])
    legacy = completion_logprobs(out, 0, 10)
    assert legacy == {"tokens": ["a", "b"], "token_logprobs": [-0.1, -3.0],
                      "top_logprobs": [{"a": -0.1, "c": -2.0}, {"d": -0.5}],
                      "text_offset": [10, 11]}
    chat = chat_logprobs(out, 1)["content"]
    assert chat == [{"token": "b", "logprob": -3.0, "bytes": [98],
                     "top_logprobs": [{"token": "d", "logprob": -0.5, "bytes": [100]}]}]


def test_streamable_text_holds_back_a_possible_stop_string():
    out = CompletionOutput(0, "hello wor")
    assert streamable_text(out, ["world"]) == "hello"
    assert streamable_text(out, []) == "hello wor"
    out.finish_reason = "length"
    assert streamable_text(out, ["world"]) == "hello wor"


def test_presets_validate_and_default_yaml_is_the_serving_default():
    for path in sorted(CONFIGS.glob("*.yaml")):
        if path.name != "serve.yaml":
            load_config(path)
    assert load_config(CONFIGS / "default.yaml") == with_default_pools(EngineConfig())


@pytest.mark.parametrize("section, message", [
    ({"serving": {"port": 70000}}, "serving.port: got 70000"),
    ({"serving": {"min_replicas": 3, "max_replicas": 2}}, "serving.min_replicas/max_replicas"),
    ({"serving": {"api_key": 5}}, "serving.api_key: got 5; expected str or null"),
])
def test_serving_config_errors_name_the_field(section, message):
    with pytest.raises(ValueError, match=message.replace("/", ".")):
        config_from_dict(section)


def test_model_sampling_defaults_fill_only_the_omitted_fields():
    req = parse_request(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5})
    sp = req.sampling_params(8, None, None, {"temperature": 0.2, "top_p": 0.9, "top_k": 20})
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.2, 0.5, 20)
    assert req.sampling_params(8, None, None).temperature == 1.0   # OpenAI's default


def test_structured_fields_become_one_spec_and_two_are_refused():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_request(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    assert json.loads(req.structured_spec().json) == schema
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "p",
                                            "guided_choice": ["a", "b"]})
    assert req.structured_spec().choice == ["a", "b"]
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "p", "guided_regex": "a",
                                            "structured_outputs": {"json_object": True}})
    with pytest.raises(ValueError, match="guided_regex: sent with structured_outputs"):
        req.structured_spec()
