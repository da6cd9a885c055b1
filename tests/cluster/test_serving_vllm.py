"""vLLM's API surface over real HTTP on a real local Ray instance: two router replicas
behind Serve's proxy (the metrics must add up whichever replica answers a scrape),
``logit_bias``, ``best_of``, ``stop_reason``, ``/tokenize`` / ``/detokenize`` /
``/version``, unknown fields, and ``python -m cluster serve`` with vLLM's flags."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from benchmarks.metric_samples import Samples, scrape, total
from cluster.config import config_from_dict, with_default_pools
from tests.cluster.server_process import popen_stoppable_by_sigint

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ROOT = Path(__file__).resolve().parents[2]
_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def server(serve_apps, tiny_factory) -> Iterator[str]:
    """``/``: the default model behind two router replicas; ``/tiny``: a tiny random
    checkpoint (no tokenizer), for logprobs against HF transformers."""
    tiny = with_default_pools(config_from_dict({
        "model": {"path": tiny_factory("llama").path},
        "cache": {"kv_cache_bytes": 8 << 20},
        "scheduler": {"max_num_batched_tokens": 16},   # prompts prefill in chunks
        "cluster": {"name": "serving-vllm-tiny",
                    "pools": [{"role": "prefill", "resources": {"CPU": 0.25}},
                              {"role": "decode", "resources": {"CPU": 0.25}}]}}))
    config = with_default_pools(config_from_dict({
        "cache": {"kv_cache_bytes": 256 << 20},
        "cluster": {"name": "serving-vllm",
                    "pools": [{"role": "prefill", "resources": {"CPU": 0.5}},
                              {"role": "decode", "resources": {"CPU": 0.5}}]},
        "serving": {"min_replicas": 2, "max_replicas": 2}}))
    with serve_apps({"/": config, "/tiny": tiny}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server, openai_client):
    return openai_client(server, _TIMEOUT_S)


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json=body, timeout=_TIMEOUT_S)


# ---- metrics with two router replicas --------------------------------------------------
COUNTS = ("counter", "histogram")   # the families whose samples never decrease


def test_metrics_add_up_across_two_router_replicas_under_load(server, client):
    from ray import serve

    router = serve.status().applications["default"].deployments["Router"]
    assert router.replica_states.get("RUNNING") == 2
    before = scrape(server, COUNTS)
    prompts = [f"Count from {i} to {i + 5}:" for i in range(12)]
    usages: list = []
    lock = threading.Lock()

    def send(i: int) -> None:
        out = client.completions.create(model=MODEL, prompt=prompts[i], temperature=0,
                                        max_tokens=4 + i % 5)
        with lock:
            usages.append(out.usage)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    scrapes = []
    for _ in range(20):
        scrapes.append(scrape(server, COUNTS))
        time.sleep(0.1)
    for t in threads:
        t.join()
    scrapes.append(scrape(server, COUNTS))
    for older, newer in zip([before, *scrapes], scrapes):
        for key, value in older.items():
            assert newer.get(key, 0.0) >= value, (key, value, newer.get(key))
    after = scrapes[-1]

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    n = len(prompts)
    assert delta("vllm:request_success_total", model_name=MODEL) == n
    assert delta("vllm:request_success_total", finished_reason="length") == n
    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("vllm:time_to_first_token_seconds_count") == n
    assert delta("vllm:e2e_request_latency_seconds_count") == n
    assert delta("vllm:inter_token_latency_seconds_count") == \
        sum(u.completion_tokens - 1 for u in usages)
    assert delta("vllm:prefix_cache_queries_total") >= sum(u.prompt_tokens for u in usages)


def test_refusals_are_counted_once_whichever_replica_refused(server):
    def counted() -> float:
        samples = scrape(server, COUNTS)
        return total(samples, "llm_cluster_errors_total", kind="unsupported_field")

    before = counted()
    for _ in range(6):
        assert _post(f"{server}/v1/completions",
                     {"model": MODEL, "prompt": "Hi", "bogus": 1}).status_code == 400
    deadline = time.monotonic() + 60   # the count is sent without waiting for it
    while counted() - before < 6:
        assert time.monotonic() < deadline, counted() - before
        time.sleep(0.2)
    assert counted() - before == 6


# ---- request fields ------------------------------------------------------------------
def test_unknown_fields_are_400_naming_them(client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                       extra_body={"guided_banana": 1, "zzz": 2})
    message = e.value.body["message"]
    assert "guided_banana" in message and "zzz" in message


def test_logit_bias_forces_the_token(server, client):
    token = _post(f"{server}/tokenize", {"prompt": " Paris", "add_special_tokens": False}
                  ).json()["tokens"][-1]
    out = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=4,
                                    temperature=0, logprobs=0,
                                    logit_bias={str(token): 100})
    expected = _post(f"{server}/detokenize", {"tokens": [token] * 4}).json()["prompt"]
    assert out.choices[0].text == expected
    banned = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=3, temperature=0,
                                       logit_bias={str(token): -100})
    assert "Paris" not in banned.choices[0].text
    plain = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=3, temperature=0)
    assert "Paris" in plain.choices[0].text   # so the ban above did something


def test_logit_bias_out_of_the_vocabulary_is_400(server):
    resp = _post(f"{server}/v1/completions", {"model": MODEL, "prompt": "Hi",
                                              "logit_bias": {"999999": 5}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logit_bias"


def test_a_priority_under_fcfs_is_400_naming_it(server):
    """The scheduler refuses it (it would be ignored); ``serve --scheduling-policy
    priority`` takes it (``test_serve_applies_vllm_flags``)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    reply = _post(f"{server}/v1/completions", {**body, "priority": 3})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "priority"
    assert "scheduler.policy: priority" in reply.json()["error"]["message"]
    assert _post(f"{server}/v1/completions", {**body, "priority": 0}).status_code == 200


def test_best_of_returns_the_sample_with_the_highest_cumulative_logprob(client):
    """Oracle: the same seeded samples asked for as ``n`` with their logprobs, ranked by
    the test's own sum of their token logprobs."""
    common = dict(model=MODEL, prompt="A short poem about the sea:", max_tokens=8,
                  temperature=1.0, seed=7)
    samples = client.completions.create(n=4, logprobs=0, **common).choices
    sums = [sum(c.logprobs.token_logprobs) for c in samples]
    ranked = sorted(range(4), key=lambda i: -sums[i])
    best = client.completions.create(n=2, best_of=4, **common)
    assert [c.text for c in best.choices] == [samples[i].text for i in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in samples)


def test_best_of_fewer_than_n_or_streamed_is_400(server):
    url = f"{server}/v1/completions"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert _post(url, {**body, "n": 3, "best_of": 2}).json()["error"]["param"] == "best_of"
    assert _post(url, {**body, "best_of": 2, "stream": True}).status_code == 400


def test_stop_reason_names_the_stop_string_or_token(server, client):
    got = _post(f"{server}/v1/chat/completions", {
        "model": MODEL, "messages": QUESTION, "max_tokens": 32, "temperature": 0,
        "stop": ["Paris"]}).json()["choices"][0]
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", "Paris")
    ids = _post(f"{server}/tokenize", {"messages": QUESTION}).json()["tokens"]
    greedy = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       logprobs=0)
    third = _post(f"{server}/tokenize", {"prompt": greedy.choices[0].logprobs.tokens[2],
                                         "add_special_tokens": False}).json()["tokens"][0]
    cut = _post(f"{server}/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0,
        "stop_token_ids": [third]}).json()["choices"][0]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", third)
    short = _post(f"{server}/v1/completions", {"model": MODEL, "prompt": "Hi",
                                               "max_tokens": 1}).json()["choices"][0]
    assert (short["finish_reason"], short["stop_reason"]) == ("length", None)


# ---- prompt logprobs and echo --------------------------------------------------------
def test_echo_and_prompt_logprobs_equal_hf_log_softmax(server, tiny_factory):
    """Oracle: HF transformers' log-softmax over the prompt, on the tiny checkpoint the
    /tiny application serves (1 prefill + 1 decode worker, prompts in 16-token chunks)."""
    hf = tiny_factory("llama").hf
    ids = torch.randint(3, hf.config.vocab_size, (37,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    model = httpx.get(f"{server}/tiny/v1/models", timeout=_TIMEOUT_S).json()["data"][0]["id"]
    resp = _post(f"{server}/tiny/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True,
        "logprobs": 2, "prompt_logprobs": 3, "n": 2})
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        echoed = choice["logprobs"]["token_logprobs"]
        assert len(echoed) == len(ids) + 3 and echoed[0] is None
        np.testing.assert_allclose(echoed[1:len(ids)],
                                   [float(want[p - 1, ids[p]]) for p in range(1, len(ids))],
                                   atol=1e-4)
        prompt = choice["prompt_logprobs"]
        assert len(prompt) == len(ids) and prompt[0] is None
        for p in range(1, len(ids)):
            top = want[p - 1].topk(3)
            ranked = sorted((e for e in prompt[p].items() if e[1]["rank"] is not None),
                            key=lambda e: e[1]["rank"])
            assert [int(t) for t, _ in ranked] == top.indices.tolist()
            np.testing.assert_allclose([e["logprob"] for _, e in ranked], top.values.numpy(),
                                       atol=1e-4)
            assert prompt[p][str(ids[p])]["logprob"] == pytest.approx(
                float(want[p - 1, ids[p]]), abs=1e-4)
    streamed = _post(f"{server}/tiny/v1/completions", {
        "model": model, "prompt": ids, "stream": True, "echo": True, "logprobs": 1})
    assert streamed.status_code == 400


# ---- endpoints -----------------------------------------------------------------------
def test_tokenize_detokenize_round_trip_and_models(server, client):
    text = "Hello, world! Ünïcode and   spaces."
    tok = _post(f"{server}/tokenize", {"model": MODEL, "prompt": text,
                                       "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert _post(f"{server}/detokenize", {"model": MODEL, "tokens": tok["tokens"]}
                 ).json()["prompt"] == text
    models = httpx.get(f"{server}/v1/models", timeout=_TIMEOUT_S).json()["data"]
    assert tok["max_model_len"] == models[0]["max_model_len"] > 0
    # the chat form tokenizes what /v1/chat/completions sends the model
    chat = _post(f"{server}/tokenize", {"messages": QUESTION}).json()
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    assert _post(f"{server}/detokenize", {"tokens": [10**9]}).status_code == 400
    assert _post(f"{server}/tokenize", {"model": "other", "prompt": "x"}).status_code == 404


def test_version(server):
    assert httpx.get(f"{server}/version", timeout=_TIMEOUT_S).json() == {
        "version": importlib.metadata.version("ray-llm-cluster")}


# ---- `python -m cluster serve` with vLLM's flags ---------------------------------------
def test_serve_applies_vllm_flags(tmp_path, free_ports):
    """Each setting read back from the running server: the model id and context length
    from /v1/models, the key from a 401, the chat template from /tokenize, the block size
    and KV dtype from the pool's block count, prefix caching from its hit counter, the
    scheduling policy from a request with a priority that fcfs would refuse."""
    from workers.loading import load_checkpoint

    (port,) = free_ports(1)
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    pool_bytes = 64 << 20
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"cache": {"kv_cache_bytes": pool_bytes}}))
    cmd = [sys.executable, "-m", "cluster", "serve", "--config", str(config),
           "--port", str(port), "--max-model-len", "640", "--served-model-name", "vllm-style",
           "--block-size", "32", "--kv-cache-dtype", "float16", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "256", "--no-enable-prefix-caching", "--seed", "3",
           "--dtype", "float", "--api-key", "k3y", "--generation-config", "vllm",
           "--gpu-memory-utilization", "0.5", "--chat-template", str(template),
           "--scheduling-policy", "priority"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = popen_stoppable_by_sigint(cmd, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k3y"}
    try:
        deadline = time.monotonic() + _TIMEOUT_S
        while "Serving" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(1)
        assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 401
        model = httpx.get(f"{url}/v1/models", headers=auth, timeout=60).json()["data"][0]
        assert (model["id"], model["max_model_len"]) == ("vllm-style", 640)
        tok = httpx.post(f"{url}/tokenize", headers=auth, timeout=60,
                         json={"messages": [{"role": "user", "content": "hi"}]}).json()
        plain = httpx.post(f"{url}/tokenize", headers=auth, timeout=60,
                           json={"prompt": "[hi]", "add_special_tokens": False}).json()
        assert tok["tokens"] == plain["tokens"]
        cfg = load_checkpoint(None).config
        block_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim \
            * 32 * 2   # K and V, fp16, 32 tokens a block
        prompt = "The quick brown fox jumps over the lazy dog. " * 8
        for priority in (0, -2):   # fcfs would refuse -2
            resp = httpx.post(f"{url}/v1/completions", headers=auth, timeout=_TIMEOUT_S,
                              json={"model": "vllm-style", "prompt": prompt, "max_tokens": 2,
                                    "priority": priority})
            assert resp.status_code == 200, resp.text

        def free_blocks(samples: Samples) -> list[float]:
            return [v for (name, _), v in samples.items()
                    if name == "llm_cluster_kv_cache_free_blocks"]

        samples = scrape(url)
        while free_blocks(samples) != [pool_bytes // block_bytes] * 2:   # all given back
            assert time.monotonic() < deadline, free_blocks(samples)
            time.sleep(0.5)
            samples = scrape(url)
        assert total(samples, "vllm:prefix_cache_hits_total") == 0   # caching is off
        assert total(samples, "vllm:prefix_cache_queries_total") > 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
