"""The Responses API's mapping onto the chat path, without a cluster.

A request becomes a chat body (checked field by field against what the chat endpoint
takes), a refusal of the chat path names the Responses field, and a chat stream's
chunks become Responses events that the ``openai`` package's own event types accept,
ending in a response whose output equals the non-streamed one. Over HTTP against the
default model: ``test_tool_serving.py``.
"""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from cluster.openai_protocol import APIError
from cluster.responses_api import ResponsesRequest, _renamed, parse_request
from cluster.responses_events import EventStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _chat(body: dict) -> tuple[dict, list[str]]:
    return parse_request(ResponsesRequest, {"model": "m", **body}).chat_body()


def test_text_input_and_instructions_become_a_system_and_a_user_message():
    body, sources = _chat({"input": "Hi!", "instructions": "Be brief.", "include": [],
                           "max_output_tokens": 5, "temperature": 0.0, "seed": 3})
    assert body == {"model": "m", "temperature": 0.0, "seed": 3, "max_completion_tokens": 5,
                    "messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hi!"}]}
    assert sources == ["instructions", "input"]


def test_items_calls_and_outputs_become_the_chat_history():
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"}
    second = {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'}
    body, sources = _chat({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Paris and Rome?"}]},
        call, second,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "developer", "content": "Answer in one line."}]})
    assert body["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "developer", "content": "Answer in one line."}]
    assert sources == ["input.0", "input.1", "input.3", "input.4", "input.6"]


def test_tools_tool_choice_text_format_and_stream_take_the_chat_shapes():
    schema = {"type": "json_schema", "name": "city", "schema": WEATHER, "strict": True}
    body, _ = _chat({"input": "x", "stream": True, "parallel_tool_calls": False,
                     "tools": [{"type": "function", "name": "get_weather",
                                "description": "d", "parameters": WEATHER}],
                     "tool_choice": {"type": "function", "name": "get_weather"},
                     "text": {"format": schema}})
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "d", "parameters": WEATHER}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "city", "schema": WEATHER, "strict": True}}
    assert (body["stream"], body["stream_options"], body["parallel_tool_calls"]) == \
        (True, {"include_usage": True}, False)
    assert _chat({"input": "x", "text": {"format": {"type": "json_object"}}})[0][
        "response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "store": True}, "store", "keeps no responses"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
     "not supported"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning", "not supported"),
    ({"input": "x", "truncation": "auto"}, "truncation", "'disabled'"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "adds nothing"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ({"input": [{"type": "input_image", "image_url": "u"}]}, "input.0", "'input_image'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0", "with role 'tool'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input.0.content", "text only"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input.0.call_id", "expected a string"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "function tools only"),
])
def test_what_is_not_a_chat_request_is_a_400_naming_the_field(body, param, words):
    with pytest.raises(APIError) as info:
        _chat(body)
    assert (info.value.status, info.value.param) == (400, param)
    assert words in info.value.message


def test_a_chat_refusal_names_the_responses_field():
    sources = ["instructions", "input.0", "input.2"]
    e = _renamed(APIError(400, "messages.2.content: too long", param="messages.2.content"),
                 sources)
    assert (e.param, e.message) == ("input.2.content", "input.2.content: too long")
    e = _renamed(APIError(400, "messages.0: bad", param="messages.0"), sources)
    assert e.param == "instructions"
    e = _renamed(APIError(400, "max_completion_tokens: too many",
                          param="max_completion_tokens"), sources)
    assert (e.param, e.message) == ("max_output_tokens", "max_output_tokens: too many")
    e = _renamed(APIError(400, "max_tokens asks for 9 more; lower max_tokens to 2",
                          param="max_tokens"), sources)
    assert e.message == "max_output_tokens asks for 9 more; lower max_output_tokens to 2"
    assert _renamed(APIError(400, "seed: x", param="seed"), sources).param == "seed"
    for chat, responses in [("tools.1.function.name", "tools.1.name"),
                            ("tool_choice.function.name", "tool_choice.name"),
                            ("response_format.json_schema.schema", "text.format.schema"),
                            ("response_format.type", "text.format.type"), ("tools", "tools")]:
        e = _renamed(APIError(400, f"{chat}: bad", param=chat), sources)
        assert (e.param, e.message) == (responses, f"{responses}: bad")


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def test_a_chat_stream_becomes_events_the_openai_types_accept():
    from openai.types.responses import ResponseStreamEvent

    stream = EventStream()
    events = stream.text("reasoning_content", "think")
    events += stream.text("content", "Hello")
    events += stream.text("content", " there")
    events += stream.call({"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}})
    events += stream.call({"index": 0, "function": {"arguments": '{"city": "Paris"}'}})
    events += stream.close_text()
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(
        json.loads(e.split("data: ", 1)[1])) for e in events]
    assert [e.type for e in parsed] == [
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.split("\n", 1)[0] for e in events] == [f"event: {e.type}" for e in parsed]
    assert [item["type"] for item in stream.output] == ["reasoning", "message",
                                                        "function_call"]
    assert stream.output[1]["content"][0]["text"] == "Hello there"
    assert (stream.output[2]["call_id"], stream.output[2]["arguments"],
            stream.output[2]["status"]) == ("call_1", '{"city": "Paris"}', "completed")
    assert [e.output_index for e in parsed if e.type == "response.output_item.done"] == \
        [0, 1, 2]


def test_a_whole_stream_ends_in_the_response_the_openai_types_accept():
    """``response.created`` to ``response.completed`` from a chat stream as the chat path
    sends it (a role chunk, text, the finish, the usage chunk, ``[DONE]``)."""
    import asyncio
    from types import SimpleNamespace

    from openai.types.responses import ResponseStreamEvent

    from cluster.responses_api import ResponsesEndpoint

    def chunk(delta: dict, finish: str | None = None) -> str:
        return _sse({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    async def chat_stream():
        for sse in (chunk({"role": "assistant", "content": ""}), chunk({"content": "Hello"}),
                    chunk({"content": " there"}, "length"),
                    _sse({"choices": [], "usage": {"prompt_tokens": 7,
                                                   "completion_tokens": 2,
                                                   "total_tokens": 9}}),
                    "data: [DONE]\n\n"):
            yield sse

    req = parse_request(ResponsesRequest, {"model": "m", "input": "Hi", "stream": True,
                                           "max_output_tokens": 2, "metadata": {"k": "v"}})
    endpoint = ResponsesEndpoint(SimpleNamespace(model_name="m"))

    async def collect() -> list[str]:
        return [e async for e in endpoint._events(req, "resp_1", chat_stream(), ["input"])]

    events = [TypeAdapter(ResponseStreamEvent).validate_python(
        json.loads(e.split("data: ", 1)[1])) for e in asyncio.run(collect())]
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1]
    assert done.type == "response.incomplete"   # the terminal event names the status
    response = done.response
    assert (response.output_text, response.status, response.incomplete_details.reason) == \
        ("Hello there", "incomplete", "max_output_tokens")
    assert (response.usage.input_tokens, response.usage.output_tokens,
            response.usage.total_tokens) == (7, 2, 9)
    assert (response.id, response.model, response.metadata) == ("resp_1", "m", {"k": "v"})
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "Hello there"


def test_a_failure_mid_stream_ends_in_an_error_and_response_failed():
    import asyncio
    from types import SimpleNamespace

    from openai.types.responses import ResponseStreamEvent

    from cluster.responses_api import ResponsesEndpoint

    async def chat_stream():
        yield _sse({"choices": [{"index": 0, "delta": {"content": "Hel"},
                                 "finish_reason": None}]})
        yield _sse({"error": {"message": "the cluster cannot serve requests now",
                              "type": "server_error", "param": None, "code": "unavailable"}})
        yield "data: [DONE]\n\n"

    req = parse_request(ResponsesRequest, {"model": "m", "input": "Hi", "stream": True})
    endpoint = ResponsesEndpoint(SimpleNamespace(model_name="m"))

    async def collect() -> list[str]:
        return [e async for e in endpoint._events(req, "resp_1", chat_stream(), ["input"])]

    events = [TypeAdapter(ResponseStreamEvent).validate_python(
        json.loads(e.split("data: ", 1)[1])) for e in asyncio.run(collect())]
    error, failed = events[-2:]
    assert (error.type, error.code) == ("error", "unavailable")
    assert failed.type == "response.failed"
    assert (failed.response.status, failed.response.error.code) == ("failed", "server_error")
    assert "cannot serve" in failed.response.error.message


def test_a_whole_chat_answer_becomes_reasoning_message_and_call_items():
    """The chat answer as the chat path shapes it (with a reasoning parser and a call),
    and the chat body the request became, seen by the chat endpoint."""
    import asyncio

    from openai.types.responses import Response

    from cluster.openai_serving import Answer
    from cluster.responses_api import ResponsesEndpoint

    class Chat:
        model_name = "m"
        seen: list[dict] = []

        async def chat_completions(self, body: dict) -> Answer:
            self.seen.append(body)
            message = {"role": "assistant", "reasoning_content": "think", "content": "Sure.",
                       "tool_calls": [{"id": "call_9", "type": "function", "function": {
                           "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
            return Answer("chatcmpl-1", body={
                "created": 5, "choices": [{"index": 0, "message": message,
                                           "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})

    chat = Chat()
    answer = asyncio.run(ResponsesEndpoint(chat).create({"model": "m", "input": "Oslo?"}))
    response = Response.model_validate(answer.body)
    assert chat.seen == [{"model": "m", "messages": [{"role": "user", "content": "Oslo?"}]}]
    assert [item.type for item in response.output] == ["reasoning", "message",
                                                       "function_call"]
    assert response.output[0].content[0].text == "think"
    assert (response.output_text, response.status) == ("Sure.", "completed")
    assert (response.output[2].call_id, response.output[2].arguments) == \
        ("call_9", '{"city": "Oslo"}')
    assert answer.request_id == response.id and response.id.startswith("resp_")
