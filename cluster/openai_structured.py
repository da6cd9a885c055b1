"""Structured-output request fields: OpenAI's ``response_format`` and vLLM's own.

OpenAI clients send ``response_format`` (``json_object``, or ``json_schema`` with a
schema and ``strict``); vLLM clients send ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (older) or ``structured_outputs`` (current). All
become one ``StructuredOutputsParams``; asking for two constraints at once is refused
naming both, never a silent pick, and a grammar that does not compile is refused naming
the field it came in.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.protocol import StructuredOutputsParams
from workers.structured_output import grammar_for


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` request object."""

    model_config = ConfigDict(strict=True, extra="ignore")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The request fields that constrain the output; mixed into both endpoints' requests."""

    model_config = ConfigDict(strict=True, extra="ignore")
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The one constraint this request asks for, or None; a ``ValueError`` whose
        message starts with the offending field's name."""
        asked: dict[str, dict[str, Any]] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked["response_format"] = {"json_object": True}
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format.json_schema: missing; a json_schema "
                                 "response format needs {name, schema}")
            asked["response_format"] = {"json": rf.json_schema.schema_}
        guided = {"guided_json": ("json", self.guided_json),
                  "guided_regex": ("regex", self.guided_regex),
                  "guided_choice": ("choice", self.guided_choice),
                  "guided_grammar": ("grammar", self.guided_grammar)}
        for name, (kind, value) in guided.items():
            if value is not None:
                asked[name] = {kind: value}
        so = self.structured_outputs
        if so is not None:
            given = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                     "grammar": so.grammar, "json_object": so.json_object or None}
            for kind, value in given.items():
                if value is not None:
                    asked[f"structured_outputs.{kind}"] = {kind: value}
        if not asked:
            return None
        if len(asked) > 1:
            first, *rest = asked
            raise ValueError(f"{first}: sent with {', '.join(rest)}; each constrains the "
                             "output, send only one")
        (param, spec), = asked.items()
        (kind,) = spec
        try:
            params = StructuredOutputsParams(**spec)
            grammar_for(params)
        except ValueError as e:   # named by its kind; renamed to the field that was sent
            raise ValueError(f"{param}: "
                             f"{str(e).removeprefix(f'structured_outputs.{kind}: ')}") from None
        return params
