"""How a choice is shown: the completions and chat answer shapes, whole or streamed.

A choice's output grows token by token; the router sends it either once at the end
(a ``choices`` entry) or as SSE chunks of what is new since the last one. The chat
shapes also split the text into reasoning and content (with a reasoning parser) and,
once a choice has finished with tool calls expected, into OpenAI's tool calls. Kept
apart from the router, which only picks the shape for the endpoint and sends it.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.openai_choices import Choice
from cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    finish_reason,
    prompt_logprobs_json,
    stop_reason,
)
from cluster.output_processor import streamable_text
from cluster.reasoning import ReasoningParser
from cluster.tool_calls import ToolCallParser, ToolCallSplit
from workers.tokenizer import Tokenizer


def sse_event(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body``."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class ResponseShaper:
    """The ``choices`` entries of one model's answers: chunks while streaming
    (``*_chunk``, ``first`` for the opening one), or the whole choice (``*_choice``)."""

    def __init__(self, reasoning: ReasoningParser | None, tool_parser: ToolCallParser,
                 tokenizer: Tokenizer | None) -> None:
        self.reasoning = reasoning
        self.tool_parser = tool_parser
        self.tokenizer = tokenizer   # to show an echoed prompt's first token

    @staticmethod
    def _delta(c: Choice) -> tuple[str, int, bool]:
        """New streamable text and the first unsent token; marks them sent."""
        text = streamable_text(c.out, c.params.stop)
        new, start = text[c.sent_text:], c.sent_tokens
        c.sent_text, c.sent_tokens = len(text), len(c.out.token_ids)
        return new, start, c.out.finished

    def completion_chunk(self, req: CompletionRequest, c: Choice,
                         first: bool) -> list[dict[str, Any]]:
        if first:
            if not req.echo or c.prompt is None:
                return []
            return [{"index": c.index, "text": c.prompt, "logprobs": None,
                     "finish_reason": None}]
        new, start, done = self._delta(c)
        if not new and not done:
            return []
        logprobs = completion_logprobs(c.out, start, 0) if c.params.logprobs is not None \
            else None
        return [{"index": c.index, "text": new, "logprobs": logprobs,
                 "finish_reason": finish_reason(c.out) if done else None,
                 "stop_reason": stop_reason(c.out)}]

    def chat_chunk(self, req: ChatCompletionRequest, c: Choice,
                   first: bool) -> list[dict[str, Any]]:
        """A choice's next chunks: its new text, and once it has finished with tool calls,
        OpenAI's tool-call deltas (per call: index, id and name, then the arguments)."""
        if first:
            return [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}]
        new, start, done = self._delta(c)
        delta = {"content": new} if new else {}
        calls = []
        if self.reasoning is not None or req.calls_expected():
            reasoning, content, split = self._answer_parts(
                req, streamable_text(c.out, c.params.stop), done)
            delta = {}
            if reasoning is not None and len(reasoning) > c.sent_reasoning:
                delta["reasoning_content"] = reasoning[c.sent_reasoning:]
            if len(content or "") > c.sent_content:
                delta["content"] = content[c.sent_content:]
            c.sent_reasoning, c.sent_content = len(reasoning or ""), len(content or "")
            calls = split.calls if split is not None and not c.calls_sent else []
            c.calls_sent = c.calls_sent or bool(calls)
        if not delta and not done:
            return []
        logprobs = chat_logprobs(c.out, start) if c.params.logprobs is not None else None
        body = {"index": c.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason(c.out) if done else None,
                "stop_reason": stop_reason(c.out)}
        if not calls:
            return [body]
        out = [{**body, "finish_reason": None}]
        for i, call in enumerate(calls):
            head = {"index": i, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            args = {"index": i, "function": {"arguments": call.arguments}}
            out += [{"index": c.index, "delta": {"tool_calls": [part]}, "logprobs": None,
                     "finish_reason": None} for part in (head, args)]
        out[-1]["finish_reason"] = finish_reason(c.out, called=True)
        return out

    def _answer_parts(self, req: ChatCompletionRequest, text: str, done: bool
                      ) -> tuple[str | None, str | None, ToolCallSplit | None]:
        """An output's reasoning (with a reasoning parser), its content so far (all of it
        once done, else what can be streamed) and, once done with calls expected, the
        calls parsed from it."""
        reasoning, content = None, text
        if self.reasoning is not None:
            parts = self.reasoning.split(text, done)
            reasoning, content = parts.reasoning, parts.content
        if not req.calls_expected():
            return reasoning, content, None
        if not done:
            return reasoning, self.tool_parser.streamable_content(content), None
        split = req.returned_calls(self.tool_parser.parse(content))
        return reasoning, split.content, split

    def completion_choice(self, req: CompletionRequest, c: Choice) -> dict[str, Any]:
        head = c.prompt if req.echo and c.prompt is not None else ""
        logprobs = completion_logprobs(c.out, 0, len(head)) \
            if c.logprobs else None
        if logprobs is not None and req.echo and c.prompt_logprobs is not None:
            tok = self.tokenizer
            first = tok.decode(c.prompt_ids[:1], skip_special_tokens=False) if tok else ""
            echoed = echo_logprobs(c.prompt_ids, c.prompt_logprobs, first)
            logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
        choice = {"index": c.index, "text": head + c.out.text, "logprobs": logprobs,
                  "finish_reason": finish_reason(c.out), "stop_reason": stop_reason(c.out)}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs or [])
        return choice

    def chat_choice(self, req: ChatCompletionRequest, c: Choice) -> dict[str, Any]:
        logprobs = chat_logprobs(c.out, 0) if c.params.logprobs is not None else None
        reasoning, content, split = self._answer_parts(req, c.out.text, True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        calls = split.calls if split is not None else []
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        return {"index": c.index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason(c.out, called=bool(calls)),
                "stop_reason": stop_reason(c.out)}
