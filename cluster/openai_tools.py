"""Tool request fields: OpenAI's ``tools``, ``tool_choice`` and the calls in the history.

``tools`` reach the chat template (as transformers passes them); ``tool_choice``
``required`` or a named function becomes the parser's forcing grammar, and ``none``
leaves the output as content. ``parallel_tool_calls: false`` returns only an answer's
first call, as vLLM does (a forced answer holds one call anyway). An assistant
message's ``tool_calls`` carry arguments as JSON text (OpenAI's shape); templates expect
a dict (transformers' shape), so they are decoded here, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.tool_calls import ToolCallParser, ToolCallSplit
from scheduler.protocol import StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str   # JSON text


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_template_input(self, param: str) -> dict[str, Any]:
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"{param}.function.arguments: not JSON ({e}); send the "
                             "arguments as the JSON text the call returned") from None
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class OfferedTools(_Strict):
    """The tools a conversation offers the model (also what ``/tokenize`` and
    ``LLM.chat`` take)."""

    tools: list[ToolDef] | None = None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ToolFields(OfferedTools):
    """The chat request's tool fields."""

    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def calls_expected(self) -> bool:
        """Whether the output is parsed for calls (tools given and not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    def returned_calls(self, split: ToolCallSplit) -> ToolCallSplit:
        """The calls an answer returns: all it wrote, or only the first."""
        if self.parallel_tool_calls or len(split.calls) < 2:
            return split
        return ToolCallSplit(split.content, split.calls[:1])

    def tool_forcing(self, parser: ToolCallParser) -> StructuredOutputsParams | None:
        """The grammar that ``required`` or a named function asks for; a ``ValueError``
        starting with the field's name when the choice cannot be met."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return None
        if not self.tools:
            raise ValueError(f"tool_choice: {_shown(choice)} needs tools; send the tools "
                             "the model may call, or leave tool_choice out")
        name = None
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            known = [t.function.name for t in self.tools]
            if name not in known:
                raise ValueError(f"tool_choice: names {name!r}, which is not among the "
                                 f"tools ({', '.join(known)}); name one of them")
        return parser.forcing(self.tool_dicts() or [], name)


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.model_dump())
