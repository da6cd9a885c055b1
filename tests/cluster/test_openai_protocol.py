"""OpenAI request parsing, response pieces and the Prometheus rendering, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import EngineConfig, config_from_dict, load_config, with_default_pools
from cluster.metrics import Histogram, RouterMetrics
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
from scheduler.protocol import Role, TierStats
from scheduler.stats import CellStats, TransferStats, WorkerReport, WorkerState
from scheduler.tiering import TierUsage

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_completion_request_fields_and_sampling_params():
    req = parse_request(CompletionRequest, {
        "model": "m", "prompt": [[1, 2], [3]], "max_tokens": 5, "temperature": 0,
        "top_k": 4, "stop": "x", "seed": 10, "ignore_eos": True, "unknown_field": 1})
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


def test_histogram_buckets_are_cumulative():
    h = Histogram("x_seconds", "x", buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.render()[2:] == ['llm_cluster_x_seconds_bucket{le="0.1"} 2',
                              'llm_cluster_x_seconds_bucket{le="1.0"} 3',
                              'llm_cluster_x_seconds_bucket{le="+Inf"} 4',
                              "llm_cluster_x_seconds_sum 3.65", "llm_cluster_x_seconds_count 4"]


def test_router_metrics_tpot_and_scheduler_gauges():
    m = RouterMetrics()
    m.observe_request(arrival=10.0, first_token=10.5, end=12.5, num_tokens=5)
    assert (m.ttft.total, m.tpot.total, m.e2e.total) == (0.5, 0.5, 2.5)
    worker = WorkerReport("decode-0", Role.DECODE, WorkerState.SERVING, num_blocks=100,
                          num_free_blocks=75, num_used_blocks=25, num_running=3,
                          num_waiting=1, worker_num_seqs=3, prefix_hit_rate=0.5,
                          kv_received=TransferStats(count=2, bytes=1024, seconds=0.25))
    stats = CellStats([worker], num_requests=4, num_waiting=1, num_handoffs=0,
                      num_recovered=0)
    text = m.render(stats)
    assert 'llm_cluster_kv_cache_usage_ratio{role="decode",worker="decode-0"} 0.25' in text
    assert 'llm_cluster_kv_transfer_bytes_total{role="decode",worker="decode-0"} 1024' in text
    assert "host_kv" not in text   # long contexts off: no tier series
    worker.tiers = TierUsage(host_blocks=64, host_used=16, offloaded_seqs=2, sparse_seqs=1)
    worker.tier_stats = TierStats(offloaded_blocks=40, received_blocks=8,
                                  recalled_blocks=96, recall_hits=32)
    text = m.render(stats)
    labels = '{role="decode",worker="decode-0"}'
    for line in (f"host_kv_usage_ratio{labels} 0.25", f"num_requests_offloaded{labels} 2",
                 f"kv_offloaded_blocks_total{labels} 40", f"kv_recall_hits_total{labels} 32",
                 f"kv_host_received_blocks_total{labels} 8"):
        assert f"llm_cluster_{line}" in text


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
