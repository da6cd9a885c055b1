"""Tool calls in a model's own text format, parsed into OpenAI's ``tool_calls``.

Models write calls in their family's format: Hermes-style ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` (Qwen2.5 / Qwen3; SmolLM2 writes a JSON list inside
the tags) or Llama 3's bare JSON ``{"name": ..., "parameters": {...}}``. The parser is
chosen by ``serving.tool_call_parser`` or, left unset, from the chat template. Text that
does not parse as calls (malformed JSON, unknown shape) is returned as content, never
dropped. ``tool_choice`` ``required`` or a named function is enforced with the
structured-output grammar of the parser's format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.protocol import StructuredOutputsParams

if TYPE_CHECKING:
    from workers.tokenizer import Tokenizer

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
# What a template without tool support is told, as a system message (Hermes's words).
_HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query.\n<tools>\n{tools}\n</tools>\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


def parser_for_template(template: str | None) -> str:
    """The format a chat template teaches: Llama 3's JSON where the template asks for
    ``"parameters"`` JSON (its ipython role), Hermes tags otherwise (also the format a
    template without tool support is given, see ``template_messages``)."""
    if template and _OPEN not in template and "ipython" in template \
            and "parameters" in template:
        return "llama3_json"
    return "hermes"


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return bool(template) and "tools" in template


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallSplit:
    content: str | None   # None: the output was only calls
    calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallParser:
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: got {self.kind!r}; allowed: "
                             f"{', '.join(TOOL_CALL_PARSERS)} (or null: from the template)")

    def parse(self, text: str) -> ToolCallSplit:
        """The calls in a finished output and the content around them; all content
        when the calls do not parse."""
        if self.kind == "hermes":
            start = text.find(_OPEN)
            if start < 0:
                return ToolCallSplit(text, [])
            try:
                values = [json.loads(m.group(1)) for m in _HERMES_CALL.finditer(text, start)]
            except json.JSONDecodeError:
                return ToolCallSplit(text, [])
            calls = _calls_from(values)
            if calls is None:
                return ToolCallSplit(text, [])
            return ToolCallSplit(text[:start].rstrip() or None, calls)
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return ToolCallSplit(text, [])
        calls = _calls_from(_json_sequence(body))
        return ToolCallSplit(text, []) if calls is None else ToolCallSplit(None, calls)

    def streamable_content(self, text: str) -> str:
        """The content of an unfinished output that is safe to stream: it stops before
        anything that could still become a call, so streamed text is never taken back."""
        if self.kind == "hermes":
            start = text.find(_OPEN)
            cut = start if start >= 0 else len(text) - _partial_open(text)
            return text[:cut].rstrip()
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(_PYTHON_TAG) \
                or _PYTHON_TAG.startswith(body):
            return ""
        return text

    def call_text(self, name: str, arguments: Any) -> str:
        """A call as the model writes it (for history rendered by templates that do not
        render ``tool_calls`` themselves)."""
        if self.kind == "hermes":
            return f'{_OPEN}\n{json.dumps({"name": name, "arguments": arguments})}\n{_CLOSE}'
        return json.dumps({"name": name, "parameters": arguments})

    def forcing(self, tools: list[dict[str, Any]], name: str | None
                ) -> StructuredOutputsParams:
        """The grammar for ``tool_choice`` ``required`` (any of ``tools``) or a named
        function: exactly one call, its arguments valid against its parameters schema."""
        chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        key = "arguments" if self.kind == "hermes" else "parameters"
        schema = {"anyOf": [
            {"type": "object", "properties": {
                "name": {"const": f["name"]},
                key: f.get("parameters") or {"type": "object"}},
             "required": ["name", key], "additionalProperties": False} for f in chosen]}
        if self.kind == "llama3_json":
            return StructuredOutputsParams(json=schema)
        return StructuredOutputsParams(grammar=(
            f"start: {json.dumps(_OPEN + chr(10))} call {json.dumps(chr(10) + _CLOSE)}\n"
            f"call: %json {json.dumps(schema)}"))


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template: str | None, parser: ToolCallParser) -> list[dict[str, Any]]:
    """``messages`` for a template that renders no tools (SmolLM2's): the tools become
    a system message in the parser's format and earlier calls the text the model wrote.
    A template that renders tools gets the messages unchanged."""
    if supports_tools(template):
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(parser.call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            m = {"role": "assistant", "content": "\n".join(p for p in (m["content"], calls) if p)}
        out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = _HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, parser: ToolCallParser | None = None,
                add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The prompt text of a conversation with ``tools`` offered, as the HTTP chat endpoint
    and ``LLM.chat`` render it: through ``template_messages`` for a template that renders
    no tools, with the format ``parser`` writes (else the template's own)."""
    template = tokenizer.template_for(bool(tools))
    parser = parser or ToolCallParser(parser_for_template(template))
    return tokenizer.apply_chat_template(
        template_messages(messages, tools, template, parser),
        add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs)


def _calls_from(values: list[Any]) -> list[ToolCall] | None:
    """Calls from decoded JSON values, each one call or a list of calls; None if any
    is not."""
    calls = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = item.get("arguments", item.get("parameters", {}))
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def _json_sequence(body: str) -> list[Any]:
    """Llama 3's calls: JSON objects separated by ``;`` (or whitespace); a text that is
    not entirely such objects gives a list holding a non-call, so it parses as content."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            value, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError:
            return [None]
        values.append(value)
        while i < len(body) and body[i] in "; \n\t":
            i += 1
    return values


def _partial_open(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0
