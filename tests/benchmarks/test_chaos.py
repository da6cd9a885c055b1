"""The chaos run's own parts: the requests it sends are valid, and its constraint check
tells a kept constraint from a broken one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from benchmarks.chaos import CONSTRAINTS, checkable, make_request, obeys
from cluster.config import load_config
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request


@pytest.mark.parametrize("long", [False, True])
def test_every_request_is_one_the_server_accepts(long):
    rng = random.Random(7)
    kinds = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    seen = set()
    for _ in range(300):
        path, body = make_request(rng, "m", long)
        req = parse_request(kinds[path], body)   # raises APIError on a bad one
        req.sampling_params(body["max_tokens"], None, None)
        req.structured_spec()
        seen.add(path)
    assert seen == set(kinds)


def _choice(content=None, tool_calls=None):
    return {"message": {"content": content, "tool_calls": tool_calls}}


def test_the_constraint_check():
    schema, json_object, choice, regex, tools = CONSTRAINTS
    assert obeys(schema, _choice('{"name": "Ann", "age": 3}'))
    assert not obeys(schema, _choice('{"name": "Ann", "age": "3"}'))
    assert not obeys(schema, _choice('{"name": "Ann"'))
    assert obeys(json_object, _choice("{}")) and not obeys(json_object, _choice("[]"))
    assert obeys(choice, _choice("maybe")) and not obeys(choice, _choice("perhaps"))
    assert obeys(regex, _choice("abc de fgh")) and not obeys(regex, _choice("abc"))
    assert obeys(tools, _choice(tool_calls=[{"id": "1"}])) and not obeys(tools, _choice("hi"))


def test_only_answers_the_constraint_ended_are_checked():
    """A stop string of the request's own (here "a", inside "<tool_call>") or the length
    limit ends an answer before its constraint completes; EOS, a stop token or a tool
    call ends it where the constraint allows."""
    def ended(finish_reason, stop_reason=None):
        return {"finish_reason": finish_reason, "stop_reason": stop_reason}
    assert checkable(ended("stop")) and checkable(ended("tool_calls"))
    assert checkable(ended("stop", 2))   # a stop token id
    assert not checkable(ended("stop", "a")) and not checkable(ended("length"))


def test_the_long_context_config_loads_and_offloads_the_long_prompts():
    config = load_config(Path(__file__).parents[2] / "benchmarks" / "chaos_long_context.yaml")
    lc = config.long_context
    assert lc.enabled and lc.offload_boundary < 1800 < config.scheduler.max_model_len
