"""Sampling defaults, structured output and reasoning over real HTTP, on real local Ray.

The application is what ``python -m cluster serve`` runs (the default model on one
prefill and one decode worker, so constrained sequences cross a KV handoff), with the
qwen3 reasoning parser. Oracles: ``jsonschema`` for every constrained answer, the
printed ``curl`` example run by the shell exactly as printed, and for reasoning a regex
constraint that makes the model write a known ``<think>`` shape.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from cluster.config import config_from_dict, with_default_pools

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
_TIMEOUT_S = 600.0
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "country": {"type": "string", "maxLength": 24},
    "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
    "required": ["city", "country", "population"], "additionalProperties": False}
COUNTRIES = ["France", "Italy", "Spain", "Germany", "Japan", "Canada", "Brazil", "Egypt",
             "India", "Kenya", "Peru", "Norway", "Chile", "Greece", "Mexico", "Poland",
             "Turkey", "Vietnam", "Ireland", "Morocco"]


@pytest.fixture(scope="module")
def server(serve_apps) -> Iterator[str]:
    config = with_default_pools(config_from_dict({
        "cache": {"kv_cache_bytes": 256 << 20},
        "cluster": {"name": "structured-test",
                    "pools": [{"role": "prefill", "resources": {"CPU": 0.5}},
                              {"role": "decode", "resources": {"CPU": 0.5}}]},
        "serving": {"reasoning_parser": "qwen3"}}))
    with serve_apps({"/": config}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server, openai_client):
    return openai_client(server, _TIMEOUT_S)


def test_printed_curl_example_answers_paris(server):
    """First in the module: the fresh workers' generators start from the configured seed,
    so the sampled answer (temperature 0.2, top_p 0.9 from the model card) is fixed."""
    from cluster.cli import curl_example

    command = curl_example(server, MODEL)
    done = subprocess.run(command + " --max-time 600 -s", shell=True, capture_output=True,
                          text=True, check=True)
    answer = json.loads(done.stdout)["choices"][0]["message"]["content"]
    assert "Paris" in answer


def test_models_lists_the_sampling_defaults(server):
    data = httpx.get(f"{server}/v1/models", timeout=60).json()["data"][0]
    assert data["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9}


def _ask(client, country: str, stream: bool) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                  "strict": True}}
    messages = [{"role": "user", "content": f"The capital of {country} and its population, "
                 "as JSON with keys city, country, population."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=96,
                                           temperature=0, response_format=fmt, stream=stream)
    if not stream:
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content
    chunks = list(reply)
    assert chunks[-1].choices[0].finish_reason == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(client, stream):
    with ThreadPoolExecutor(len(COUNTRIES)) as pool:
        answers = list(pool.map(lambda c: _ask(client, c, stream), COUNTRIES))
    for answer in answers:
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_vllm_guided_fields_constrain_the_completion(server):
    body = {"model": MODEL, "prompt": "Is the sky blue? Answer:", "max_tokens": 8,
            "guided_choice": ["yes", "no"]}
    reply = httpx.post(f"{server}/v1/completions", json=body, timeout=_TIMEOUT_S).json()
    assert reply["choices"][0]["text"] in ("yes", "no")
    body = {"model": MODEL, "prompt": "Year:", "max_tokens": 8,
            "structured_outputs": {"regex": "(19|20)[0-9]{2}"}}
    reply = httpx.post(f"{server}/v1/completions", json=body, timeout=_TIMEOUT_S).json()
    assert len(reply["choices"][0]["text"]) == 4 and reply["choices"][0]["text"][:2] in (
        "19", "20")


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_bad_constraints_are_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=_TIMEOUT_S)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


def test_reasoning_moves_think_into_reasoning_content(client):
    thinking = {"structured_outputs": {"regex": "<think>[a-z]{4}</think>[a-z]{3}"},
                "chat_template_kwargs": {"enable_thinking": True}}
    messages = [{"role": "user", "content": "Think, then answer."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                           temperature=0, extra_body=thinking)
    message = reply.choices[0].message
    assert len(message.reasoning_content) == 4 and len(message.content) == 3
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                            temperature=0, extra_body=thinking, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) \
        == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


def test_chat_template_kwargs_cannot_replace_request_fields(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"add_generation_prompt": False}}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=_TIMEOUT_S)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "chat_template_kwargs"
