"""OpenAI's request and response shapes for the completion and chat endpoints.

Requests are pydantic models in strict mode (a string where a number belongs is a
400, not a silent conversion), with OpenAI's field names plus vLLM's sampling extras;
a field the server does not implement is a 400 naming it, never silently dropped.
Responses are plain dicts built from the engine's ``CompletionOutput``. Every refusal
is an ``APIError`` that the router renders as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import typing
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from cluster.openai_structured import StructuredFields
from cluster.openai_tools import MessageToolCall, ToolFields
from cluster.outputs import CompletionOutput, Logprob
from scheduler.protocol import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, shown


@dataclass
class APIError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields (the
    optional ones by keyword, so that a parameter's name cannot land in ``type``)."""

    status: int
    message: str
    _: KW_ONLY
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    @classmethod
    def bad_value(cls, e: ValueError) -> APIError:
        """A 400 for a ``ValueError`` whose message starts with the field it names
        (``"temperature: got -1.0; ..."``), as validation here words them."""
        head = str(e).split(":", 1)[0]
        return cls(400, str(e), param=head if head.replace(".", "").replace("_", "")
                   .isalnum() else None)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingFields(StructuredFields):
    """The fields both endpoints share: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    priority: int = 0

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the answer shows (None: no prompt logprobs)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        seed: int | None, defaults: Mapping[str, float | int] | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """One choice's parameters (the cluster runs n=1 per sequence: each choice is its
        own request, with ``seed + index`` when a seed is given); ``defaults`` (the
        model's generation config) fill the sampling fields the request left out;
        ``structured`` constrains the output."""
        given = {name: getattr(self, name) for name in
                 ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        model = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set}
        try:
            return SamplingParams(
                n=1, **{**given, **model},
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, seed=seed, stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output,
                max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                structured_outputs=structured,
                logit_bias=parse_logit_bias(self.logit_bias),
                prompt_logprobs=self.wanted_prompt_logprobs)
        except ValueError as e:
            raise APIError.bad_value(e) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """``echo`` with ``logprobs`` shows the prompt's logprobs too, as vLLM does."""
        echoed = self.logprobs if self.echo else None
        if echoed is None or self.prompt_logprobs is None:
            return echoed if echoed is not None else self.prompt_logprobs
        return max(echoed, self.prompt_logprobs)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (OpenAI accepts one or many, as text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        """Only an assistant message that calls tools may leave its content out, as
        OpenAI has it."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"role {self.role!r} needs content (text or text parts); only "
                             "an assistant message with tool_calls may omit it")
        return self

    def as_template_input(self, param: str = "messages") -> dict[str, Any]:
        """The message as chat templates expect it (``param``: its place in the request,
        named by errors)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [c.as_template_input(f"{param}.tool_calls.{i}")
                                     for i, c in enumerate(self.tool_calls)]
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message


class ChatCompletionRequest(ToolFields, _SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    # Range-checked here, not only as SamplingParams' max_tokens and logprobs, so that a
    # refusal names the field the client sent.
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def parse_request(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; fields the model does not declare are a 400 naming
    them all, any other problem a 400 naming its field.

    OpenAI's optional fields are nullable, null meaning "not given", and clients send it
    for options they leave unset: a null for a field that takes no None here (or that
    this server does not have) is dropped, so the field keeps its default. A field that
    takes None (``max_tokens``: no limit but the context) keeps the null."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object; got {type(body).__name__}")
    body = {k: v for k, v in body.items() if v is not None or _takes_none(model, k)}
    unknown = sorted(set(body) - set(model.model_fields))
    if unknown:
        names = ", ".join(unknown)
        raise APIError(400, f"{names}: not supported by this server; leave "
                       f"{'it' if len(unknown) == 1 else 'them'} out", param=unknown[0],
                       code="unsupported_field")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        param, message = _problem_shown(e)
        raise APIError(400, message, param=param or None) from None


def _takes_none(model: type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    return field is not None and type(None) in typing.get_args(field.annotation)


_MESSAGES = TypeAdapter(list[ChatMessage])


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages given as plain JSON (a batch row's ``messages``), checked as the
    chat endpoint checks them, as chat templates expect them; a ``ValueError`` names
    the bad field."""
    try:
        messages = _MESSAGES.validate_python(value)
    except ValidationError as e:
        _, message = _problem_shown(e, "messages")
        raise ValueError(message) from None
    if not messages:
        raise ValueError("messages: got []; give at least one message")
    return [m.as_template_input(f"messages.{i}") for i, m in enumerate(messages)]


def _problem_shown(e: ValidationError, prefix: str = "") -> tuple[str, str]:
    """The field and message of a validation error worth showing: the deepest, since of
    a union's members the one that got furthest says most (a content part of type
    "image_url" rather than "content is not a string")."""
    err = max(e.errors(), key=lambda err: len(_field_path(err["loc"])))
    param = ".".join([prefix, *_field_path(err["loc"])] if prefix else _field_path(err["loc"]))
    if err["type"] == "value_error":   # a validator's own words, which name the problem
        return param, f"{param}: {err['ctx']['error']}"
    got = f"; got {shown(err.get('input'))}" if err["type"] != "missing" else ""
    return param, f"{param}: {err['msg']}{got}"


def _field_path(loc: tuple[str | int, ...]) -> list[str]:
    """An error's location without the union members pydantic names in it (``str``,
    ``list[int]``, a model's class name)."""
    return [str(p) for p in loc if not (isinstance(p, str) and (
        p in ("str", "int", "float", "bool") or "[" in p or p[:1].isupper()))]


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def finish_reason(out: CompletionOutput, called: bool = False) -> str | None:
    """OpenAI knows stop and length, and tool_calls for an output that stopped with calls
    (``called``); an aborted sequence reports none."""
    if called and out.finish_reason == "stop":
        return "tool_calls"
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


def stop_reason(out: CompletionOutput) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or stop token id that ended the choice;
    None for EOS, the length limit, or a choice still running."""
    return out.stop_reason if out.finished else None


MAX_LOGIT_BIAS = 100.0


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token id as a JSON key -> a bias in [-100, 100]) as the
    sampler's {token id: bias}."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias: got the key {key!r}; keys are token ids "
                           "(non-negative integers as strings)", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias: got {value} for token {key}; biases lie in "
                           f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", param="logit_bias")
        out[int(key)] = float(value)
    return out


def _legacy_logprobs(rows: Iterable[tuple[int, dict[int, Logprob]]],
                     text_offset: int) -> dict[str, list[Any]]:
    """The legacy completions ``logprobs`` lists for (token, its logprob entry) rows, the
    first row's text starting at ``text_offset``."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, entry in rows:
        piece = entry[tok].decoded_token or ""
        tokens.append(piece)
        token_lps.append(entry[tok].logprob)
        tops.append({lp.decoded_token or "": lp.logprob
                     for lp in sorted((v for v in entry.values() if v.rank is not None),
                                      key=lambda v: v.rank)})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def completion_logprobs(out: CompletionOutput, start: int, text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for tokens ``start:`` of ``out``."""
    return _legacy_logprobs(zip(out.token_ids[start:], (out.logprobs or [])[start:]),
                            text_offset)


def echo_logprobs(prompt_ids: list[int], prompt_lps: list[dict[int, Logprob] | None],
                  first_piece: str) -> dict[str, Any]:
    """The legacy ``logprobs`` object of an echoed prompt: its first token has none."""
    rest = _legacy_logprobs(zip(prompt_ids[1:], prompt_lps[1:]), len(first_piece))
    return {"tokens": [first_piece, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def prompt_logprobs_json(prompt_lps: list[dict[int, Logprob] | None]
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id:
    {logprob, rank, decoded_token}}, the prompt's own token included."""
    return [None if entry is None else
            {str(tok): {"logprob": lp.logprob, "rank": lp.rank,
                        "decoded_token": lp.decoded_token} for tok, lp in entry.items()}
            for entry in prompt_lps]


def chat_logprobs(out: CompletionOutput, start: int) -> dict[str, Any]:
    """The chat ``logprobs`` object (``content``: one entry a token) for tokens ``start:``."""
    def item(text: str | None, logprob: float) -> dict[str, Any]:
        text = text or ""
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for tok, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
        top = sorted((v for v in entry.values() if v.rank is not None), key=lambda v: v.rank)
        content.append({**item(entry[tok].decoded_token, entry[tok].logprob),
                        "top_logprobs": [item(v.decoded_token, v.logprob) for v in top]})
    return {"content": content}


def envelope(kind: str, request_id: str, model: str, created: int | None = None
             ) -> dict[str, Any]:
    """The fields every response and chunk starts with."""
    return {"id": request_id, "object": kind, "created": created or int(time.time()),
            "model": model}
