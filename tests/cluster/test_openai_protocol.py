"""OpenAI request parsing and response pieces, without a server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.metric_samples import parse
from cluster import metrics
from cluster.config import EngineConfig, config_from_dict, load_config, with_default_pools
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    parse_messages,
    parse_request,
)
from cluster.output_processor import streamable_text
from cluster.outputs import CompletionOutput, Logprob
from scheduler.protocol import Role, TierStats
from scheduler.stats import (
    CellStats,
    PoolReport,
    StepTimes,
    TransferStats,
    WorkerReport,
    WorkerState,
)
from scheduler.tiering import TierUsage

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
    ({"model": "m", "prompt": ["a", 3]}, "prompt.1"),
])
def test_wrong_types_name_their_field(body, param):
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.type == "invalid_request_error"


def test_a_huge_bad_value_is_shown_shortened():
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "seed": "7" * 100_000})
    assert e.value.param == "seed" and len(e.value.message) < 150
    assert "got '7777" in e.value.message and "7...7" in e.value.message
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, {"model": "m", "prompt": "hi",
                                          "temperature": list(range(100_000))})
    assert e.value.message.endswith("got [0, 1, 2, 3, 4, 5, ...]")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fields, param, words", [
    # Of a union's members, the error of the one that got furthest.
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type", "'image_url'"),
    # Chat's own names, not the SamplingParams fields they become.
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs", "20"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "1"),
])
def test_chat_refusals_name_the_field_the_client_sent(fields, param, words):
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, {**CHAT, **fields})
    assert (e.value.param, e.value.type) == (param, "invalid_request_error")
    assert e.value.message.startswith(f"{param}: ") and words in e.value.message


def test_batch_messages_are_checked_as_the_chat_endpoint_checks_them():
    assert parse_messages([{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                           {"role": "user", "content": "b"}]) == [
        {"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    for value, words in (("hi", "messages: Input should be a valid list"),
                         ([], "messages: got []"),
                         ([{"role": "bot", "content": "x"}], "messages.0.role: "),
                         ([{"role": "user"}], "messages.0: role 'user' needs content")):
        with pytest.raises(ValueError, match=f"^{re.escape(words)}"):
            parse_messages(value)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert parse_messages([{"role": "assistant", "tool_calls": [call]}])[0]["content"] == ""


def test_api_error_fields_past_the_message_are_keywords():
    with pytest.raises(TypeError):
        APIError(400, "n: got 0", "n")   # would have made "n" the error's type
    err = APIError.bad_value(ValueError("top_k: got -5; allowed range is [0, inf]"))
    assert (err.status, err.param, err.type) == (400, "top_k", "invalid_request_error")
    assert APIError.bad_value(ValueError("the prompt has 9 tokens: too many")).param is None


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


def test_metrics_render_transports_migrations_pools_and_tiers():
    """The series the typed snapshot adds to vLLM's (see test_vllm_api): handoffs per
    transport, migrations, recent latencies, pools and autoscaler decisions, and the
    long-context tiers only when on; parsed back by prometheus_client."""
    worker = WorkerReport("decode-0", Role.DECODE, WorkerState.SERVING, num_blocks=100,
                          num_free_blocks=75, num_used_blocks=25, num_running=3,
                          num_waiting=1, worker_num_seqs=3, prefix_hit_rate=0.5,
                          step_times=StepTimes(steps=9),
                          kv_received=TransferStats(count=3, bytes=1024, seconds=0.25,
                                                    transports={"shm": 2, "object_store": 1},
                                                    pushes=4, pushed_bytes=4096))
    pool = PoolReport(Role.DECODE, target=2, serving=1, pending=1, draining=0,
                      min_workers=1, max_workers=4, scale_ups=3, scale_downs=1)
    stats = CellStats([worker], num_requests=4, num_waiting=1, num_handoffs=0,
                      num_recovered=0, num_migrated=5, ttft_s=0.5, pools=[pool])

    got = parse(metrics.render(stats, "m").decode())
    m = (("model_name", "m"),)
    w = (("model_name", "m"), ("role", "decode"), ("worker", "decode-0"))
    assert got[("llm_cluster_kv_transfers_total", w)] == 3
    for transport, count in (("shm", 2), ("object_store", 1)):
        assert got[("llm_cluster_kv_transfers_by_transport_total",
                    (*w[:2], ("transport", transport), w[2]))] == count
    assert got[("llm_cluster_worker_steps_total", w)] == 9
    assert got[("llm_cluster_kv_pushes_total", w)] == 4
    assert got[("llm_cluster_kv_pushed_bytes_total", w)] == 4096
    assert got[("llm_cluster_migrated_requests_total", m)] == 5
    assert got[("llm_cluster_recent_ttft_seconds", m)] == 0.5
    assert not any(name == "llm_cluster_recent_tpot_seconds" for name, _ in got)   # no data
    assert got[("llm_cluster_pool_workers", (*m, ("role", "decode"), ("state", "pending")))] == 1
    assert got[("llm_cluster_pool_target_workers", (*m, ("role", "decode")))] == 2
    for direction, count in (("up", 3), ("down", 1)):
        assert got[("llm_cluster_autoscale_decisions_total",
                    (("direction", direction), *m, ("role", "decode")))] == count
    assert not any("host_kv" in name for name, _ in got)   # long contexts off
    worker.tiers = TierUsage(host_blocks=64, host_used=16, offloaded_seqs=2, sparse_seqs=1)
    worker.tier_stats = TierStats(offloaded_blocks=40, received_blocks=8,
                                  recalled_blocks=96, recall_hits=32)
    got = parse(metrics.render(stats, "m").decode())
    assert got[("llm_cluster_host_kv_usage_ratio", w)] == 0.25
    assert got[("llm_cluster_num_requests_offloaded", w)] == 2
    assert got[("llm_cluster_kv_offloaded_blocks_total", w)] == 40
    assert got[("llm_cluster_kv_recall_hits_total", w)] == 32


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
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "p", "guided_regex": "(("})
    with pytest.raises(ValueError, match=r"^guided_regex: cannot be compiled"):
        req.structured_spec()
