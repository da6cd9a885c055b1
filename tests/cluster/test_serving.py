"""The OpenAI-compatible server on a real local Ray instance, reached over real HTTP.

Two Serve applications share the session's Ray instance: ``/`` is what ``python -m
cluster serve`` runs (the default model on 1 prefill + 1 decode worker), driven with
the official ``openai`` client and checked against the one-process engine's greedy
output; ``/limited`` has an API key and room for one running and one waiting
request, for the 401 and overload tests.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from benchmarks.metric_samples import scrape, total
from cluster.config import config_from_dict, with_default_pools
from scheduler.protocol import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
_START_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def server(serve_apps) -> Iterator[str]:
    main = with_default_pools(config_from_dict({
        "cache": {"kv_cache_bytes": 256 << 20},
        "cluster": {"name": "serving-test",
                    "pools": [{"role": "prefill", "resources": {"CPU": 0.5}},
                              {"role": "decode", "resources": {"CPU": 0.5}}]}}))
    limited = config_from_dict({
        "cache": {"kv_cache_bytes": 128 << 20},   # about 2,900 tokens of this model
        "scheduler": {"max_num_seqs": 1},
        "cluster": {"name": "serving-limited", "max_waiting": 1,
                    "pools": [{"role": "mixed", "resources": {"CPU": 0.5}}]},
        "serving": {"api_key": KEY}})
    with serve_apps({"/": main, "/limited": limited}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server, openai_client):
    return openai_client(server, _START_TIMEOUT_S)


@pytest.fixture(scope="module")
def local_llm():
    """The one-process engine on the same model: the oracle for greedy text."""
    from cluster.llm import LLM

    return LLM()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


# ---- the openai client ---------------------------------------------------------------
def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_a_model_is_retrieved_by_its_id(client):
    listed = client.models.list().data[0]
    assert client.models.retrieve(MODEL) == listed
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


def test_completion_equals_the_offline_engine(client, local_llm):
    prompt = "The three primary colors are"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    want = local_llm.generate(prompt, _greedy(24))[0].outputs[0]
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == len(local_llm.get_tokenizer().encode(prompt))


def test_chat_completion_equals_the_offline_engine(client, local_llm):
    got = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                         temperature=0)
    want = local_llm.chat(QUESTION, _greedy(32))[0].outputs[0].text
    assert got.choices[0].message.content == want
    assert "Paris" in want
    assert got.choices[0].message.role == "assistant"


def test_chat_continues_a_begun_assistant_reply_as_offline(server, client, local_llm):
    """``continue_final_message``: the prompt stops inside the assistant's message (no
    end of turn: /tokenize gives the same ids as the text cut there) and the answer goes
    on from it, the offline engine's text."""
    begun = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    got = client.chat.completions.create(model=MODEL, messages=begun, max_tokens=8,
                                         temperature=0, extra_body=extra)
    want = local_llm.chat(begun, _greedy(8), add_generation_prompt=False,
                          continue_final_message=True)[0]
    assert got.choices[0].message.content == want.outputs[0].text
    assert want.outputs[0].text.startswith(" Paris")
    tok = local_llm.get_tokenizer()
    whole = tok.apply_chat_template(begun, add_generation_prompt=False)
    cut = whole[:whole.rindex("The capital of France is") + len("The capital of France is")]
    assert want.prompt_token_ids == tok.encode(cut, add_special_tokens=False)
    ids = httpx.post(f"{server}/tokenize", json={"messages": begun, **extra},
                     timeout=60).json()["tokens"]
    assert ids == want.prompt_token_ids
    both = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": begun, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == \
        "continue_final_message"


def test_streaming_chat_concatenates_to_the_same_text(client, local_llm):
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == local_llm.chat(QUESTION, _greedy(32))[0].outputs[0].text
    assert content[-1].choices[0].finish_reason in ("stop", "length")
    assert len(content) > 3   # streamed, not sent in one piece
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_stop_string_cuts_the_text(client, local_llm):
    full = local_llm.chat(QUESTION, _greedy(32))[0].outputs[0].text
    stop = "Paris"
    got = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                         temperature=0, stop=[stop])
    assert got.choices[0].message.content == full[:full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                              temperature=0, stop=[stop], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == full[:full.index(stop)]


def test_n_3_with_a_seed_gives_the_same_choices_offline_on_the_cluster_and_over_http(
        client, local_llm):
    """Choice k of a seeded request is sample index k under its seed on every path: the
    one-process engine forks its choices after the prompt, the cluster's Python client
    submits each as a request of its own, the HTTP router streams each apart."""
    import asyncio

    from cluster.cluster_client import ClusterClient

    prompt = "Once upon a time"
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=16)

    def http(n: int, seed: int) -> list[str]:
        # top_p given: a request that omits it takes the model's default (0.9), not 1.0
        out = client.completions.create(model=MODEL, prompt=prompt, n=n, seed=seed,
                                        temperature=1.0, top_p=1.0, max_tokens=16)
        assert [c.index for c in out.choices] == list(range(n))
        return [c.text for c in out.choices]

    offline = [c.text for c in local_llm.generate(prompt, params)[0].outputs]
    assert len(set(offline)) == 3   # three different samples, not one thrice
    tokenizer = local_llm.get_tokenizer()
    cell = ClusterClient.attach("serving-test", tokenizer, tokenizer.vocab_size, 2048)
    text, ids = cell.tokenize_prompt(prompt)

    async def streamed() -> list[str]:
        last = None
        async for out in cell.generate_stream(ids, params, text):
            last = out
        return [c.text for c in last.outputs]

    assert asyncio.run(streamed()) == offline
    cell.add_request("n3", text, ids, params)
    done = []
    while cell.has_unfinished():
        done += cell.step()
    assert [c.text for c in done[0].outputs] == offline
    assert http(3, seed=7) == offline
    assert http(1, seed=7) == offline[:1]   # choice 0 does not depend on n


def test_streaming_n_2_gives_both_choices(client):
    stream = client.completions.create(model=MODEL, prompt="The sky is", n=2, seed=3,
                                       temperature=1.0, max_tokens=12, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    whole = client.completions.create(model=MODEL, prompt="The sky is", n=2, seed=3,
                                      temperature=1.0, max_tokens=12)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]


def test_chat_logprobs_match_the_offline_engine(client, local_llm):
    got = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3)
    want = local_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=5,
                                                   logprobs=3))[0].outputs[0]
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.token_ids) == 5
    for item, tok, entry in zip(content, want.token_ids, want.logprobs):
        assert item.logprob == pytest.approx(entry[tok].logprob, abs=1e-4)
        assert len(item.top_logprobs) == 3
        # greedy: the sampled token is the most likely one
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)


# ---- raw HTTP: every refusal in OpenAI's error shape ----------------------------------
def _post(url: str, body: Any, headers: dict[str, str] | None = None,
          raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url, content=content, timeout=_START_TIMEOUT_S,
                      headers={"Content-Type": "application/json", **(headers or {})})


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_malformed_json_and_wrong_types_are_400(server):
    url = f"{server}/v1/chat/completions"
    _error(_post(url, None, raw=b'{"model": "x", '), 400)
    err = _error(_post(url, {"model": MODEL, "messages": QUESTION, "temperature": "hot"}), 400)
    assert err["param"] == "temperature" and "hot" in err["message"]
    err = _error(_post(url, {"model": MODEL, "messages": "hi"}), 400)
    assert err["param"].startswith("messages")
    err = _error(_post(url, {"model": MODEL, "messages": QUESTION, "top_p": 0}), 400)
    assert err["param"] == "top_p"
    _error(_post(url, [1, 2]), 400)
    _error(_post(f"{server}/v1/completions", {"prompt": "hi"}), 400)   # no model


@pytest.mark.parametrize("path, fields, param", [
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [[]]}, "prompt"),
    ("completions", {"prompt": [-1, 5]}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 200}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 100}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0.type"),
    ("chat/completions", {"messages": QUESTION, "top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {"messages": QUESTION, "top_logprobs": 30, "logprobs": True},
     "top_logprobs"),
    ("chat/completions", {"messages": QUESTION, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
])
def test_odd_inputs_are_400_and_the_server_still_answers(server, path, fields, param):
    err = _error(_post(f"{server}/v1/{path}", {"model": MODEL, **fields}), 400)
    assert (err["param"], err["type"]) == (param, "invalid_request_error"), err
    ok = _post(f"{server}/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_unknown_model_is_404(server):
    err = _error(_post(f"{server}/v1/completions", {"model": "gpt-4", "prompt": "hi"}), 404)
    assert err["code"] == "model_not_found" and MODEL in err["message"]


def test_prompt_over_the_context_length_names_both_lengths(server, client):
    limit = client.models.list().data[0].model_extra["max_model_len"]
    err = _error(_post(f"{server}/v1/completions",
                       {"model": MODEL, "prompt": [5] * (limit + 10)}), 400)
    assert str(limit + 10) in err["message"] and str(limit) in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = _error(_post(f"{server}/v1/completions",
                       {"model": MODEL, "prompt": "hi", "max_tokens": limit}), 400)
    assert str(limit) in err["message"] and err["param"] == "max_tokens"


def test_body_over_the_size_limit_is_413(server):
    huge = {"model": MODEL, "prompt": "a" * (5 << 20)}
    err = _error(_post(f"{server}/v1/completions", huge), 413)
    assert "4194304" in err["message"]


def test_api_key_is_required_where_configured(server):
    url = f"{server}/limited/v1/models"
    assert httpx.get(url, timeout=_START_TIMEOUT_S).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=_START_TIMEOUT_S)
    assert _error(wrong, 401)["type"] == "authentication_error"
    right = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=_START_TIMEOUT_S)
    assert right.status_code == 200 and right.json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{server}/v1/models", timeout=_START_TIMEOUT_S).status_code == 200


def _wait_for(check, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_overload_is_503_with_retry_after_and_loses_nothing(server):
    """One running request holds the only slot, one waits; the third is refused at
    once, and the waiting one still completes once the first is aborted."""
    auth = {"Authorization": f"Bearer {KEY}"}
    url = f"{server}/limited/v1/completions"
    long_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000,
                 "ignore_eos": True, "stream": True}
    waiting_result: dict[str, Any] = {}

    def waiter() -> None:
        waiting_result["resp"] = _post(url, {"model": MODEL, "prompt": "Hello",
                                             "max_tokens": 4, "temperature": 0}, auth)

    with httpx.stream("POST", url, json=long_body, headers=auth,
                      timeout=_START_TIMEOUT_S) as running:
        assert running.status_code == 200, running.read()
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        thread = threading.Thread(target=waiter)
        thread.start()
        waiting = "llm_cluster_num_requests_waiting"
        _wait_for(lambda: total(scrape(f"{server}/limited"), waiting) >= 1)
        refused = _post(url, {"model": MODEL, "prompt": "Hi", "max_tokens": 4}, auth)
        err = _error(refused, 503)
        assert err["code"] == "overloaded" and "max_waiting=1" in err["message"]
        assert refused.headers["retry-after"] == "1"
    thread.join(_START_TIMEOUT_S)
    resp = waiting_result["resp"]
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"


def test_a_client_that_disconnects_gives_its_blocks_back(server):
    url = f"{server}/v1/completions"
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 2000,
            "ignore_eos": True}
    with httpx.stream("POST", url, json={**body, "stream": True},
                      timeout=_START_TIMEOUT_S) as resp:
        lines = resp.iter_lines()   # left suspended: leaving the loop would close it
        for _ in range(6):
            next(lines)
        _wait_for(lambda: total(scrape(server), "llm_cluster_kv_cache_usage_ratio") > 0)
    # a non-streaming request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={**body, "prompt": "Another story"}, timeout=3.0)

    def idle() -> bool:
        return (total(scrape(server), "llm_cluster_kv_cache_usage_ratio") == 0
                and total(scrape(server), "llm_cluster_num_requests_running") == 0)

    _wait_for(idle)


def test_health_and_metrics(server, client):
    """One request's counts, as deltas of the scrape (other tests share the server)."""
    assert httpx.get(f"{server}/health", timeout=_START_TIMEOUT_S).json()["status"] == "ok"
    before = scrape(server)
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    counts = [("vllm:request_success_total", {"finished_reason": "length"}, 1),
              ("vllm:prompt_tokens_total", {}, out.usage.prompt_tokens),
              ("vllm:generation_tokens_total", {}, 4),
              ("vllm:time_to_first_token_seconds_count", {}, 1),
              ("vllm:inter_token_latency_seconds_count", {}, 3),   # gaps between 4 tokens
              ("vllm:e2e_request_latency_seconds_count", {}, 1)]

    def deltas() -> list[float]:
        after = scrape(server)
        return [total(after, name, **labels) - total(before, name, **labels)
                for name, labels, _ in counts]

    _wait_for(lambda: deltas() == [want for *_, want in counts], timeout_s=60.0)
