"""vLLM compatibility without a server: request fields (unknown ones refused,
``logit_bias``), the command line's vLLM flags, model ids from the Hugging Face cache,
chat-template overrides, and the metrics a scheduler snapshot renders."""

from __future__ import annotations

import shutil
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks.metric_samples import parse
from cluster import metrics
from cluster.cli import build_parser, main
from cluster.config import ConfigError, config_from_dict, load_config, with_overrides
from cluster.llm import engine_config
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_logit_bias,
    parse_request,
)
from cluster.vllm_args import LLM_FLAGS, SERVE_FLAGS, config_overrides, field_type
from scheduler.protocol import NewSequence, Role, SamplingParams, decode, encode
from scheduler.serving_stats import RequestTimes, ServingStats
from scheduler.stats import CellStats, TransferStats, WorkerReport, WorkerState
from workers.chat_template import load_chat_template
from workers.sampler import Sampler, SamplingRow

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# ---- request fields ------------------------------------------------------------------
@pytest.mark.parametrize("model, body", [
    (CompletionRequest, {"model": "m", "prompt": "hi"}), (ChatCompletionRequest, CHAT)])
def test_unknown_fields_are_400_naming_every_one(model, body):
    with pytest.raises(APIError) as e:
        parse_request(model, {**body, "service_tier": "flex", "zzz_field": 1})
    assert e.value.status == 400 and e.value.code == "unsupported_field"
    assert "service_tier" in e.value.message and "zzz_field" in e.value.message
    parse_request(model, body)   # the same body without them is fine


@pytest.mark.parametrize("model, body", [
    (CompletionRequest, {"model": "m", "prompt": "hi"}), (ChatCompletionRequest, CHAT)])
def test_a_null_is_a_field_not_given(model, body):
    """Every optional field sent as null (as clients send unset options) parses as if
    left out, defaults and the set of given fields alike, unknown ones included; a field
    whose null means something (max_tokens: no limit) keeps it."""
    nulls = {name: None for name in model.model_fields if name not in body}
    got = parse_request(model, {**body, **nulls, "service_tier": None})
    want = parse_request(model, body)
    assert got.model_dump() == {**want.model_dump(), "max_tokens": None}
    # not given: so the model's sampling defaults apply to them, as when left out
    assert not got.model_fields_set & {"n", "temperature", "top_p", "top_k", "stream",
                                       "presence_penalty", "frequency_penalty", "priority"}
    assert got.max_tokens is None and want.max_tokens == (16 if model is CompletionRequest
                                                          else None)


def test_logit_bias_is_parsed_and_checked():
    assert parse_logit_bias({"5": 100, "17": -2.5}) == {5: 100.0, 17: -2.5}
    for bad in ({"x": 1.0}, {"-3": 1.0}, {"5": 100.5}):
        with pytest.raises(APIError) as e:
            parse_logit_bias(bad)
        assert e.value.param == "logit_bias" and e.value.status == 400
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "hi",
                                            "logit_bias": {"3": 7}})
    assert req.sampling_params(4, None, None).logit_bias == {3: 7.0}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


def test_logit_bias_crosses_the_msgpack_seam():
    seq = NewSequence("s", [1, 2], 2, 0, [0], 2, SamplingParams(logit_bias={70000: -3.0}))
    assert decode(NewSequence, encode(seq)).sampling.logit_bias == {70000: -3.0}


def test_logit_bias_shifts_the_distribution_as_softmax_of_biased_logits():
    """Oracle: numpy's softmax of the logits plus the bias, computed by hand."""
    vocab = 50
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen) * 3
    sampler = Sampler(vocab, eos_token_ids=[2])
    best = int(logits[0].argmax())
    rows = [SamplingRow(SamplingParams(temperature=0.0, logit_bias={7: 100.0}), [1], []),
            SamplingRow(SamplingParams(temperature=0.0, logit_bias={best: -100.0}), [1], []),
            SamplingRow(SamplingParams(temperature=0.7, logit_bias={3: 2.0, 9: -1.5}),
                        [1], [])]
    out = sampler(logits, rows)
    assert out.token_ids[0] == 7   # +100 forces the token
    second = np.argsort(logits[1].numpy())[::-1]
    assert out.token_ids[1] == (second[0] if second[0] != best else second[1])
    biased = logits[2].numpy().astype(np.float64).copy()
    biased[3] += 2.0
    biased[9] -= 1.5
    expected = np.exp(biased / 0.7 - (biased / 0.7).max())
    expected /= expected.sum()
    probs = sampler.probabilities(logits, rows)[2].double().numpy()
    np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-7)


# ---- the command line ----------------------------------------------------------------
FLAG_VALUES = {   # flag -> (argument, the config value it must give)
    "--host": ("0.0.0.0", "0.0.0.0"), "--port": ("8123", 8123),
    "--api-key": ("sekret", "sekret"), "--served-model-name": ("my-model", "my-model"),
    "--generation-config": ("vllm", "vllm"), "--max-model-len": ("1024", 1024),
    "--max-num-seqs": ("7", 7), "--max-num-batched-tokens": ("512", 512),
    "--block-size": ("32", 32), "--kv-cache-dtype": ("float16", "float16"),
    "--gpu-memory-utilization": ("0.5", 0.5), "--dtype": ("half", "float16"),
    "--chat-template": ("{{ messages[0]['content'] }}", "{{ messages[0]['content'] }}"),
    "--seed": ("11", 11), "--reasoning-parser": ("qwen3", "qwen3"),
    "--quantization": ("w8a16", "w8a16"), "--scheduling-policy": ("priority", "priority"),
}


def _serve_config(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    return with_overrides(load_config(None), config_overrides(args))


@pytest.mark.parametrize("flag", SERVE_FLAGS, ids=lambda f: f.flags[0])
def test_each_vllm_flag_sets_its_config_field(flag):
    section, name = flag.section, flag.name
    if field_type(section, name) is bool:
        on, off = _serve_config(flag.flags[0]), _serve_config("--no-" + flag.flags[0][2:])
        assert (getattr(getattr(on, section), name), getattr(getattr(off, section), name)) \
            == (True, False)
        return
    arg, expected = FLAG_VALUES[flag.flags[0]]
    config = _serve_config(flag.flags[0], arg)
    assert getattr(getattr(config, section), name) == expected
    assert getattr(getattr(_serve_config(), section), name) == \
        getattr(getattr(load_config(None), section), name)   # not given: the config's


@pytest.mark.parametrize("flag", LLM_FLAGS.values(), ids=lambda f: f.keyword)
def test_each_llm_keyword_sets_what_its_serve_flag_sets(flag):
    """``LLM(max_model_len=...)`` as ``serve --max-model-len``, vLLM's value spellings
    (``dtype="half"``) included."""
    section, name = flag.section, flag.name
    tp = field_type(section, name)
    cases = [(True, flag.flags[0]), (False, "--no-" + flag.flags[0][2:])] if tp is bool \
        else [(tp(FLAG_VALUES[flag.flags[0]][0]), flag.flags[0], FLAG_VALUES[flag.flags[0]][0])]
    for value, *argv in cases:
        got = engine_config(None, None, {flag.keyword: value})
        assert getattr(getattr(got, section), name) == \
            getattr(getattr(_serve_config(*argv), section), name)


def test_llm_keywords_keep_a_keep_value_and_refuse_unknown_ones():
    assert engine_config(None, None, {"dtype": "auto"}).model.dtype == \
        load_config(None).model.dtype
    with pytest.raises(TypeError, match="trust_remote_code; allowed: model, config, "
                                        "block_size"):
        engine_config(None, None, {"trust_remote_code": True})
    with pytest.raises(ConfigError, match="cache.memory_fraction: got 1.5"):
        engine_config(None, None, {"gpu_memory_utilization": 1.5})


def test_flags_take_their_type_from_the_schema_and_every_flag_is_tested():
    srv = next(a for a in build_parser()._subparsers._group_actions[0].choices.items()
               if a[0] == "serve")[1]
    by_dest = {a.dest: a for a in srv._actions}
    for flag in SERVE_FLAGS:
        tp = field_type(flag.section, flag.name)
        assert tp is bool or by_dest[flag.dest].type is tp, flag.flags
        assert tp is bool or flag.flags[0] in FLAG_VALUES
    assert build_parser().parse_args(["serve", "org/name"]).model_tag == "org/name"
    assert _serve_config("--dtype", "auto").model.dtype == "float32"   # auto: the config's


def test_a_flag_value_the_config_refuses_names_the_field():
    with pytest.raises(ConfigError, match="cache.block_size: got 20"):
        _serve_config("--block-size", "20")
    with pytest.raises(ConfigError, match="model.generation_config"):
        _serve_config("--generation-config", "/no/such/folder")


def test_an_unknown_flag_fails_with_argparse_message(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--tensor-parallel-size", "2"])
    assert e.value.code == 2
    assert "error: unrecognized arguments: --tensor-parallel-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--max-model-len", "many"])
    assert "--max-model-len: invalid int value: 'many'" in capsys.readouterr().err


# ---- model ids and chat templates ----------------------------------------------------
def _fake_hub_cache(root, repo: str, source) -> None:
    rev = "0" * 40
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(rev)
    shutil.copytree(source, base / "snapshots" / rev)


@pytest.mark.slow
def test_org_name_models_resolve_through_the_local_hf_cache(tiny_factory, tmp_path,
                                                            monkeypatch):
    from huggingface_hub import constants

    from workers.loading import load_checkpoint

    tiny = tiny_factory("llama")
    _fake_hub_cache(tmp_path, "tiny-org/tiny-llama", tiny.path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    ckpt = load_checkpoint("tiny-org/tiny-llama")
    assert ckpt.config.vocab_size == tiny.hf.config.vocab_size
    assert torch.equal(ckpt.weights["model.embed_tokens.weight"],
                       tiny.hf.model.embed_tokens.weight)
    with pytest.raises(FileNotFoundError, match="hf download tiny-org/absent"):
        load_checkpoint("tiny-org/absent")
    from cluster.config import served_model_name
    assert served_model_name(config_from_dict({"model": {"path": "tiny-org/tiny-llama"}})) \
        == "tiny-org/tiny-llama"


def test_chat_template_from_a_file_or_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert load_chat_template(str(path)) == path.read_text()
    assert load_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ValueError, match="neither an existing file"):
        load_chat_template("no-such-template.jinja")
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for %}")


# ---- metrics -------------------------------------------------------------------------
def _worker(worker_id: str, role: str, **kw: Any) -> WorkerReport:
    base: dict[str, Any] = dict(
        state=WorkerState.SERVING, num_running=2, num_waiting=1, num_used_blocks=30,
        num_blocks=100, num_free_blocks=70, worker_num_seqs=2, prefix_hit_rate=0.25,
        prefix_queried_tokens=400, prefix_hit_tokens=100, num_preemptions=3,
        kv_received=TransferStats(bytes=1024, seconds=0.5, count=2),
        kv_sent=TransferStats(failures=1))
    return WorkerReport(worker_id, Role(role), **{**base, **kw})


def test_serving_stats_latencies_by_hand():
    stats, times = ServingStats(), RequestTimes(arrival=10.0)
    stats.tokens(times, num_prompt_tokens=12, num_new=1, now=10.5)   # ttft 0.5
    stats.tokens(times, 12, 2, now=11.5)                             # 2 gaps of 0.5
    stats.tokens(times, 12, 0, now=11.9)                             # nothing new
    stats.finish(times, "length", now=12.0)
    assert (stats.prompt_tokens, stats.generation_tokens) == (12, 3)
    assert (stats.ttft.total, stats.ttft.count) == (0.5, 1)
    assert (stats.itl.total, stats.itl.count) == (1.0, 2)
    assert (stats.e2e.total, stats.finished) == (2.0, {"length": 1})


def test_metrics_carry_vllm_names_and_the_scheduler_values():
    serving = ServingStats()
    for arrival, first, end, reason in ((0.0, 0.02, 0.3, "stop"), (0.0, 3.0, 7.0, "length")):
        t = RequestTimes(arrival)
        serving.tokens(t, 5, 1, first)
        serving.tokens(t, 5, 4, end)
        serving.finish(t, reason, end)
    serving.error("overloaded")
    stats = CellStats([_worker("prefill-0", "prefill"),
                       _worker("decode-0", "decode", num_used_blocks=50,
                               num_recomputed_tokens=17, state=WorkerState.LOST)],
                      num_requests=0, num_waiting=4, num_handoffs=0, num_recovered=1,
                      serving=serving)
    s = parse(metrics.render(stats, "tiny").decode())
    m = (("model_name", "tiny"),)
    assert s[("vllm:prompt_tokens_total", m)] == 10
    assert s[("vllm:generation_tokens_total", m)] == 10
    assert s[("vllm:request_success_total", (("finished_reason", "length"), *m))] == 1
    assert s[("vllm:request_success_total", (("finished_reason", "stop"), *m))] == 1
    assert s[("vllm:num_requests_running", m)] == 2          # live workers only
    assert s[("vllm:num_requests_waiting", m)] == 4
    assert s[("vllm:kv_cache_usage_perc", m)] == pytest.approx(0.3)
    assert s[("vllm:prefix_cache_queries_total", m)] == 800  # counters keep lost workers
    assert s[("vllm:prefix_cache_hits_total", m)] == 200
    assert s[("vllm:num_preemptions_total", m)] == 6
    ttft = "vllm:time_to_first_token_seconds"
    assert s[(f"{ttft}_bucket", (("le", "0.02"), *m))] == 1   # 0.02 is in its own bucket
    assert s[(f"{ttft}_bucket", (("le", "2.5"), *m))] == 1
    assert s[(f"{ttft}_bucket", (("le", "5.0"), *m))] == 2
    assert s[(f"{ttft}_bucket", (("le", "+Inf"), *m))] == 2
    assert s[(f"{ttft}_sum", m)] == pytest.approx(3.02)
    assert s[("vllm:e2e_request_latency_seconds_count", m)] == 2
    assert s[("vllm:inter_token_latency_seconds_count", m)] == 8
    assert s[("llm_cluster_errors_total", (("kind", "overloaded"), *m))] == 1
    worker = (("model_name", "tiny"), ("role", "decode"), ("worker", "decode-0"))
    assert s[("llm_cluster_kv_cache_usage_ratio", worker)] == 0.5
    assert s[("llm_cluster_kv_transfer_bytes_total", worker)] == 1024
    assert s[("llm_cluster_worker_alive", worker)] == 0
    assert s[("llm_cluster_recomputed_tokens_total", worker)] == 17
    assert not any(name.startswith("llm_cluster_host_kv") for name, _ in s)


# ---- prompt logprobs -------------------------------------------------------------------
@pytest.mark.slow
def test_prompt_logprobs_equal_hf_log_softmax_across_chunks_and_a_cached_prefix(
        tiny_factory):
    """Oracle: HF transformers' log-softmax over the same prompt. The prompt spans three
    prefill chunks, and its leading blocks are in the prefix cache from an earlier
    request, which a request asking for prompt logprobs must not skip."""
    from cluster.llm import LLM

    tiny = tiny_factory("llama")
    ids = torch.randint(3, tiny.hf.config.vocab_size, (40,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(tiny.path, max_num_batched_tokens=16, kv_cache_bytes=8 << 20)
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))   # fills the cache
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0,
                                             prompt_logprobs=3))[0]
    with torch.no_grad():
        want = tiny.hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry = got[p]
        assert entry[ids[p]].logprob == pytest.approx(float(want[p - 1, ids[p]]), abs=1e-4)
        top = want[p - 1].topk(3)
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None),
                        key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        np.testing.assert_allclose([lp.logprob for lp in ranked], top.values.numpy(),
                                   atol=1e-4)
        assert [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                if lp.rank is not None] == top.indices.tolist()
    none = llm.generate([ids], SamplingParams(max_tokens=1))[0]
    assert none.prompt_logprobs is None


def test_prompt_logprobs_are_reported_once_and_skip_the_prefix_cache():
    """The scheduler's side: a recomputed prompt scores positions already sent again;
    only the new ones go out. A prompt asking for them is computed from its start even
    when the prefix cache holds its leading blocks."""
    from kvcache.kv_cache_manager import KVCacheManager
    from scheduler.batch_scheduler import BatchScheduler
    from scheduler.config import SchedulerConfig
    from scheduler.protocol import SequenceOutput, StepOutput, TokenLogprobs

    def entries(n: int, first: float) -> list[TokenLogprobs]:
        return [TokenLogprobs(first - i, [], []) for i in range(n)]

    prompt = list(range(3, 43))
    batch = BatchScheduler(SchedulerConfig(max_num_batched_tokens=16),
                           KVCacheManager(64, 16, True), 512, [2])
    batch.add("a", prompt, SamplingParams(max_tokens=2, prompt_logprobs=0))
    plan = batch.schedule()
    (first,) = batch.update(StepOutput(plan.step_id, [
        SequenceOutput("a", [], None, entries(3, -1.0), 1)]))
    assert first.new_token_ids == [] and [e.token_logprob for e in first.prompt_logprobs] \
        == [-1.0, -2.0, -3.0]
    (again,) = batch.update(StepOutput(plan.step_id + 1, [   # positions 1-5, after a recompute
        SequenceOutput("a", [], None, entries(5, -1.0), 1)]))
    assert [e.token_logprob for e in again.prompt_logprobs] == [-4.0, -5.0]
    assert batch.update(StepOutput(plan.step_id + 2, [
        SequenceOutput("a", [], None, entries(2, -1.0), 1)])) == []   # nothing new

    batch = BatchScheduler(SchedulerConfig(), KVCacheManager(64, 16, True), 512, [2])
    batch.add("warm", prompt, SamplingParams(max_tokens=1))
    plan = batch.schedule()
    batch.update(StepOutput(plan.step_id, [SequenceOutput("warm", [7])]))
    batch.schedule()   # the finished sequence's blocks go back, cached
    batch.add("plain", prompt, SamplingParams(max_tokens=1))
    batch.add("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    new = {s.seq_id: s for s in batch.schedule().new}
    assert new["plain"].num_computed_tokens == 32   # two cached blocks
    assert new["scored"].num_computed_tokens == 0
