"""Tool calls over real HTTP with the official ``openai`` client, on real local Ray.

Two applications: the default model (SmolLM2, whose template renders no tools, so they
reach it as a Hermes system message) and a tiny random Qwen2 checkpoint with a byte-level
tokenizer and a Qwen2.5-style template that renders tools, calls and tool results. A
random model never chooses a call by itself, so calls are forced (``required`` or a named
function) there. Oracles: ``jsonschema`` for every call's arguments against its tool's
parameters, transformers' ``apply_chat_template`` on the tiny tokenizer for the prompt
of a history with calls and tool results (its token count is the server's
``prompt_tokens``), and the non-streamed call for the streamed one. The Responses API
(``/v1/responses``) runs on the chat path: its text, calls and token counts must equal
the chat endpoint's for the same conversation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from cluster.config import config_from_dict

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
_TIMEOUT_S = 600.0
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "Current weather of a city", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 12}},
                                          "required": ["city"],
                                          "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5-Instruct's template, shortened to its tool parts.
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are Qwen.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object within "
    "<tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _write_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer (the 3 ChatML specials, then the 256 bytes) and the
    Qwen-style template, next to the tiny checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN_TEMPLATE,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))


@pytest.fixture(scope="module")
def tiny_qwen(tiny_builder, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen-tools")
    tiny_builder("qwen2", directory, max_positions=2048, vocab_size=len(SPECIALS) + 256)
    _write_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def server(serve_apps, tiny_qwen) -> Iterator[str]:
    pools = [{"role": "mixed", "resources": {"CPU": 0.5}}]
    default = config_from_dict({"cache": {"kv_cache_bytes": 256 << 20},
                                "cluster": {"name": "tools-default", "pools": pools}})
    tiny = config_from_dict({"model": {"path": str(tiny_qwen)},
                             "cache": {"kv_cache_bytes": 32 << 20},
                             "cluster": {"name": "tools-tiny", "pools": pools},
                             "serving": {"model_name": "tiny-qwen"}})
    with serve_apps({"/": default, "/tiny": tiny}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server, openai_client):
    return openai_client(server, _TIMEOUT_S)


@pytest.fixture(scope="module")
def tiny_client(server, openai_client):
    return openai_client(f"{server}/tiny", _TIMEOUT_S)


def _check_call(call, tools=TOOLS) -> dict:
    """A returned call names one of ``tools`` and its arguments validate against it."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, params[call.function.name])
    return arguments


def _history(reply, result: str) -> list[dict]:
    """The question, the assistant's calls as returned, and a tool result for each."""
    message = reply.choices[0].message
    calls = [c.model_dump() for c in message.tool_calls]
    return QUESTION + [{"role": "assistant", "content": message.content, "tool_calls": calls},
                       *({"role": "tool", "tool_call_id": c["id"], "content": result}
                         for c in calls)]


def test_default_model_round_trip(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           tool_choice=NAMED, temperature=0, max_tokens=96)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call)
    answer = client.chat.completions.create(
        model=MODEL, messages=_history(reply, '{"temperature": 21, "sky": "sunny"}'),
        tools=TOOLS, tool_choice="none", temperature=0, max_tokens=48)
    final = answer.choices[0]
    assert final.message.tool_calls is None and final.finish_reason in ("stop", "length")
    assert final.message.content
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_default_model_required_calls_a_listed_tool(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           tool_choice="required", temperature=0,
                                           max_tokens=96)
    assert reply.choices[0].finish_reason == "tool_calls"
    for call in reply.choices[0].message.tool_calls:
        _check_call(call)


def test_streamed_call_equals_the_non_streamed_one(client):
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                  temperature=0, max_tokens=96)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    parts = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].index == 0 and parts[0].id.startswith("call_")
    assert parts[0].function.name == "get_weather"
    arguments = "".join(p.function.arguments or "" for p in parts if p.index == 0)
    assert json.loads(arguments) == json.loads(whole.function.arguments)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""


def test_tool_choice_none_returns_content(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str) and choice.message.content


TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
             '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
             '{"city": "Paris"}}\n</tool_call>')


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_returns_only_the_first_call(client, parallel, stream):
    """The answer is forced to two known calls (a one-string choice); with
    ``parallel_tool_calls`` false only the first comes back, whole or streamed."""
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=96,
                  parallel_tool_calls=parallel,
                  extra_body={"structured_outputs": {"choice": [TWO_CALLS]}})
    if stream:
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True)
                  if c.choices]
        finish = chunks[-1].choices[0].finish_reason
        parts = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        names = [p.function.name for p in parts if p.function.name]
        arguments = ["".join(p.function.arguments or "" for p in parts if p.index == i)
                     for i in range(len(names))]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        names = [c.function.name for c in choice.message.tool_calls]
        arguments = [c.function.arguments for c in choice.message.tool_calls]
    want = [("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("get_time", {"city": "Paris"})]
    assert finish == "tool_calls"
    assert list(zip(names, map(json.loads, arguments))) == (want if parallel else want[:1])


@pytest.mark.parametrize("seed", range(4))
def test_tiny_qwen_named_choice_forces_that_function(tiny_client, seed):
    reply = tiny_client.chat.completions.create(
        model="tiny-qwen", messages=QUESTION, tools=TOOLS, tool_choice=NAMED, seed=seed,
        temperature=1.0, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call)


def test_tiny_qwen_round_trip_renders_calls_and_results_as_transformers(tiny_client,
                                                                        tiny_qwen):
    import transformers

    reply = tiny_client.chat.completions.create(
        model="tiny-qwen", messages=QUESTION, tools=TOOLS, tool_choice="required", seed=7,
        temperature=1.0, max_tokens=200)
    assert reply.choices[0].finish_reason == "tool_calls"
    for call in reply.choices[0].message.tool_calls:
        _check_call(call)
    history = _history(reply, "sunny, 21 C")
    answer = tiny_client.chat.completions.create(
        model="tiny-qwen", messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_qwen)
    for m in history:   # transformers' templates take arguments as a dict
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    text = hf.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True,
                                  tokenize=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    expected = hf(text, add_special_tokens=False)["input_ids"]
    assert answer.usage.prompt_tokens == len(expected)


def test_tokenize_counts_a_conversation_with_tools_as_the_chat_endpoint(server, client):
    import httpx

    history = QUESTION + [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    counted = httpx.post(f"{server}/tokenize", json={"messages": history, "tools": TOOLS},
                         timeout=_TIMEOUT_S).json()["count"]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                           tool_choice="none", max_tokens=1)
    without = httpx.post(f"{server}/tokenize", json={"messages": history},
                         timeout=_TIMEOUT_S).json()["count"]
    assert counted == reply.usage.prompt_tokens > without


def test_offline_chat_renders_tools_as_transformers(tiny_qwen):
    """``LLM.chat(tools=...)`` on a template that renders tools: its prompt tokens are
    transformers' for the same conversation and tools."""
    import transformers

    from cluster import LLM, SamplingParams

    llm = LLM(config=config_from_dict({"model": {"path": str(tiny_qwen)},
                                       "cache": {"kv_cache_bytes": 8 << 20}}))
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=2), tools=TOOLS)[0]
    hf = transformers.AutoTokenizer.from_pretrained(tiny_qwen)
    text = hf.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True,
                                  tokenize=False)
    assert out.prompt_token_ids == hf(text, add_special_tokens=False)["input_ids"]
    assert "<tools>" in text


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "messages": QUESTION + [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{city: Paris"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
     "messages.1.tool_calls.0.function.arguments"),
])
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param):
    import httpx

    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **extra}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=_TIMEOUT_S)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


# ---- the Responses API (/v1/responses) on the chat path -----------------------------------
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]   # its tool shape


def test_responses_text_equals_the_chat_endpoint_whole_and_streamed(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer briefly."}, *QUESTION],
        temperature=0, max_tokens=12)
    kwargs = dict(model=MODEL, instructions="Answer briefly.", input=QUESTION[0]["content"],
                  temperature=0, max_output_tokens=12, metadata={"run": "test"})
    response = client.responses.create(**kwargs)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                               else "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert (response.model, response.metadata, response.id[:5]) == \
        (MODEL, {"run": "test"}, "resp_")
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        response.output_text
    assert events[-1].type == f"response.{response.status}"   # completed or incomplete
    assert events[-1].response.output_text == response.output_text


def test_responses_function_call_round_trip_equals_the_chat_endpoint(client):
    first = client.responses.create(
        model=MODEL, input=QUESTION[0]["content"], tools=FLAT_TOOLS, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=96)
    (call,) = first.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                          tool_choice=NAMED, temperature=0, max_tokens=96)
    assert json.loads(call.arguments) == \
        json.loads(chat.choices[0].message.tool_calls[0].function.arguments)
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)

    result = '{"temperature": 21, "sky": "sunny"}'
    second = client.responses.create(
        model=MODEL, input=[QUESTION[0], call.model_dump(exclude_none=True),
                            {"type": "function_call_output", "call_id": call.call_id,
                             "output": result}],
        tools=FLAT_TOOLS, tool_choice="none", temperature=0, max_output_tokens=48)
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=48)
    assert second.output_text == answer.choices[0].message.content
    assert second.usage.input_tokens == answer.usage.prompt_tokens


def test_responses_refusals_name_the_responses_field(client):
    import openai

    for kwargs, param in [({"store": True}, "store"),
                          ({"input": [{"role": "user", "content": [
                              {"type": "input_image", "image_url": "http://x"}]}]},
                           "input.0.content"),
                          ({"max_output_tokens": 10**6}, "max_output_tokens")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**{"model": MODEL, "input": "Hi", **kwargs})
        assert info.value.body["param"] == param, info.value.body
