"""OpenAI's Responses API (``POST /v1/responses``) on the chat path.

A Responses request is a chat request told another way: ``input`` (a string, or items:
messages, earlier function calls and their outputs), ``instructions`` (a leading system
message), ``max_output_tokens``, function ``tools``, ``text.format``. This module turns
one into the chat body, runs it through ``OpenAIServing.chat_completions`` (so it gets
the same validation, template, tool calls and structured output), and turns the answer
back into a ``response`` object (``output`` items: reasoning, a message, function calls)
or, streamed, into the Responses events, from ``response.created`` to the one that ends
it: ``response.completed``, ``response.incomplete`` (cut at ``max_output_tokens``) or,
after an ``error`` event, ``response.failed``.
Nothing is stored: ``store: true`` and ``previous_response_id`` are refused, and a
conversation is sent whole, as a chat conversation is (an earlier turn's reasoning items
sent back are left out, as chat templates leave out earlier reasoning). Fields not listed in
``ResponsesRequest`` are a 400 naming them.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.client_errors import client_error
from cluster.openai_protocol import APIError, parse_request
from cluster.openai_serving import Answer, OpenAIServing
from cluster.responses_events import EventStream, call_item, message_item, new_id, reasoning_item

# Fields passed to the chat request as they are (vLLM's sampling extras among them).
_SAME_FIELDS = ("model", "temperature", "top_p", "user", "parallel_tool_calls", "seed",
                "top_k", "min_p", "repetition_penalty", "priority")
# A chat field's name in a refusal, as the Responses request names it.
_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens", "response_format": "text.format"}
# A chat field's level that the Responses shape leaves out: (its place, its name).
_NESTED = {"tools": (2, "function"), "tool_choice": (1, "function"),
           "response_format": (1, "json_schema")}
_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    store: bool | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None

    def chat_body(self) -> tuple[dict[str, Any], list[str]]:
        """The chat request this one is, and where each of its messages came from (a
        field of this request); a 400 names what cannot be one."""
        if self.store:
            raise APIError(400, "store: this server keeps no responses; set store to false "
                           "and send the whole conversation in input", param="store")
        if self.include:
            raise APIError(400, f"include: got {self.include}; this server adds nothing to "
                           "a response (no logprobs, no encrypted reasoning): send an empty "
                           "list or leave it out", param="include")
        unknown = sorted(set(self.text or {}) - {"format"})
        if unknown:
            raise APIError(400, f"text.{unknown[0]}: not supported by this server; leave it "
                           "out", param=f"text.{unknown[0]}")
        body: dict[str, Any] = {k: getattr(self, k) for k in _SAME_FIELDS
                                if getattr(self, k) is not None}
        messages, sources = _messages(self.input)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
            sources.insert(0, "instructions")
        body["messages"] = messages
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.text is not None and self.text.get("format") is not None:
            body["response_format"] = _response_format(self.text["format"])
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body, sources


def _messages(given: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """``input`` as chat messages, and the item each came from; consecutive function
    calls become one assistant message's tool calls."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}], ["input"]
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in _ROLES:
            messages.append({"role": item["role"], "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": _str(i, item, "call_id"), "type": "function", "function": {
                "name": _str(i, item, "name"), "arguments": _str(i, item, "arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _str(i, item, "call_id"),
                             "content": _str(i, item, "output")})
        elif kind == "reasoning":
            continue   # an earlier turn's reasoning, sent back: templates leave it out
        else:
            raise APIError(400, f"input.{i}: got an item of type {kind!r}"
                           f"{'' if kind != 'message' else ' with role ' + repr(item.get('role'))}"
                           "; this server takes messages (role user, system, developer or "
                           "assistant), function_call, function_call_output and reasoning "
                           "items",
                           param=f"input.{i}")
        sources.append(f"input.{i}")
    return messages, sources


def _text(i: int, content: Any) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
            and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"input.{i}.content: expected text or a list of input_text parts "
                   "(this model reads text only)", param=f"input.{i}.content")


def _str(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input.{i}.{key}: got {value!r:.60}; expected a string",
                       param=f"input.{i}.{key}")
    return value


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(400, f"tools.{i}.type: got {tool.get('type')!r}; this server runs "
                       "function tools only", param=f"tools.{i}.type")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str) or choice.get("type") != "function":
        return choice   # the chat path checks the words and refuses other kinds
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return fmt   # text, json_object: the same in both APIs
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                   if k != "type"}}


class ResponsesEndpoint:
    """``POST /v1/responses`` over an ``OpenAIServing``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: Any) -> Answer:
        req: ResponsesRequest = parse_request(ResponsesRequest, body)
        chat_body, sources = req.chat_body()
        try:
            answer = await self.serving.chat_completions(chat_body)
        except APIError as e:
            raise _renamed(e, sources) from None
        response_id = new_id("resp")
        if answer.events is not None:
            return Answer(response_id, events=self._events(req, response_id, answer.events,
                                                           sources))
        chat = answer.body
        message = chat["choices"][0]["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            output.append(message_item(new_id("msg"), message.get("content") or ""))
        output += [call_item(c) for c in calls]
        return Answer(response_id, body=self._response(
            req, response_id, chat["created"], output, chat["choices"][0]["finish_reason"],
            chat["usage"]))

    def _response(self, req: ResponsesRequest, response_id: str, created: float,
                  output: list[dict[str, Any]], finish_reason: str | None,
                  usage: dict[str, int] | None, error: APIError | None = None
                  ) -> dict[str, Any]:
        """The ``response`` object: ``in_progress`` while it runs (no ``finish_reason``),
        ``failed`` with an ``error``, else ``incomplete`` when cut at the token limit or
        ``completed``."""
        status = "failed" if error is not None else "in_progress" if finish_reason is None \
            else "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": response_id, "object": "response", "created_at": created,
            "status": status, "error": None if error is None else {
                "code": _failure_code(error), "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.serving.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {},
            "store": False, "truncation": "disabled", "user": req.user,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}}

    async def _events(self, req: ResponsesRequest, response_id: str,
                      chunks: AsyncIterator[str], sources: list[str]) -> AsyncIterator[str]:
        """The chat stream's chunks as Responses events; text and reasoning stream as
        they grow, each function call as one item once the answer is parsed."""
        stream = EventStream()
        created = time.time()
        started = self._response(req, response_id, created, [], None, None)
        yield stream.event("response.created", response=started)
        yield stream.event("response.in_progress", response=started)
        finish_reason, usage = None, None
        try:
            async for sse in chunks:
                data = sse.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    raise APIError(500, error["message"], type=error["type"],
                                   param=error["param"], code=error["code"])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    for kind in ("reasoning_content", "content"):
                        if delta.get(kind):
                            for event in stream.text(kind, delta[kind]):
                                yield event
                    for call in delta.get("tool_calls") or []:
                        for event in stream.call(call):
                            yield event
                    finish_reason = choice["finish_reason"] or finish_reason
            for event in stream.close_text():
                yield event
            if not stream.output:   # no text, no call: an empty message, as whole
                for event in stream.text("content", ""):
                    yield event
                for event in stream.close_text():
                    yield event
            response = self._response(req, response_id, created, stream.output,
                                      finish_reason or "stop", usage)
            yield stream.event(f"response.{response['status']}", response=response)
        except Exception as e:
            e = _renamed(client_error(e, response_id), sources)
            yield stream.event("error", code=e.code or e.type, message=e.message,
                               param=e.param)
            yield stream.event("response.failed", response=self._response(
                req, response_id, created, stream.output, None, usage, e))
        finally:
            await chunks.aclose()   # a client gone: the chat stream aborts its choice


def _renamed(e: APIError, sources: list[str]) -> APIError:
    """A chat path's refusal, naming the field as the Responses request names it:
    ``messages.N`` as the field that message came from, a tool's or tool choice's
    ``function.`` and a response format's ``json_schema.`` left out, as the Responses
    shapes leave them out, and the renamed fields (``_RENAMED``)."""
    parts = (e.param or "").split(".")
    head = parts[0]
    if head == "messages" and len(parts) > 1 and parts[1].isdigit() \
            and int(parts[1]) < len(sources):
        source = sources[int(parts[1])]   # an input item, input (text) or instructions
        parts = [source, *parts[2:]] if source.startswith("input.") else [source]
    elif head in _NESTED:
        at, word = _NESTED[head]
        if len(parts) > at and parts[at] == word:
            del parts[at]
        parts[0] = _RENAMED.get(head, head)
    elif head in _RENAMED:
        parts[0] = _RENAMED[head]
    else:
        return e
    param = ".".join(parts)
    message = e.message.replace(e.param or "", param)
    return APIError(e.status, message, type=e.type, param=param, code=e.code,
                    retry_after_s=e.retry_after_s)


def _failure_code(e: APIError) -> str:
    """A failed response's ``error.code``: one of the Responses API's words (its event
    carries ours in ``error``'s ``code``)."""
    if e.code == "overloaded":
        return "rate_limit_exceeded"
    return "invalid_prompt" if 400 <= e.status < 500 else "server_error"
