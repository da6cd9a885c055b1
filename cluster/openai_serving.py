"""The OpenAI completions and chat endpoints' work, apart from HTTP.

A request body goes in; an ``Answer`` comes out: the whole response body, or (for a
streamed request) its server-sent events. The router sends answers over HTTP; the
batch job (``openai_batch``) writes them to an OpenAI Batch API output file. Both get
the same validation, chat rendering, tool calls and response shapes, because both run
this one path. A refusal is raised as an ``APIError``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cluster import openai_tokenize
from cluster.client_errors import client_error
from cluster.cluster_client import ClusterClient
from cluster.config import ServingConfig
from cluster.openai_choices import (
    Choice,
    best,
    best_of,
    close_all,
    make_choices,
    open_all,
    progress,
    usage,
)
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    envelope,
    parse_request,
    prompt_logprobs_json,
)
from cluster.openai_responses import ResponseShaper, sse_event
from cluster.reasoning import ReasoningParser
from cluster.tool_calls import ToolCallParser, parser_for_template
from scheduler.protocol import StructuredOutputsParams


@dataclass
class Answer:
    """What an endpoint answers: ``body`` (the whole response), or ``events`` (the
    server-sent events of a streamed one, ending with ``[DONE]``)."""

    request_id: str
    body: dict[str, Any] | None = None
    events: AsyncIterator[str] | None = None


def _structured_spec(req: Any) -> StructuredOutputsParams | None:
    try:
        return req.structured_spec()
    except ValueError as e:
        raise APIError.bad_value(e) from None


class OpenAIServing:
    """The completions and chat endpoints of one model on one cell (``client``)."""

    def __init__(self, client: ClusterClient, serving: ServingConfig, model_name: str,
                 sampling_defaults: dict[str, float | int]) -> None:
        self.client = client
        self.model_name = model_name
        self.sampling_defaults = sampling_defaults
        tok = client.tokenizer
        template = tok.template_for(True) if tok is not None else None
        self.tool_parser = ToolCallParser(serving.tool_call_parser
                                          or parser_for_template(template))
        reasoning = (ReasoningParser(serving.reasoning_parser)
                     if serving.reasoning_parser else None)
        self.shaper = ResponseShaper(reasoning, self.tool_parser, tok)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r} (see GET /v1/models)", type="not_found_error",
                           param="model", code="model_not_found")

    def count_error(self, e: APIError) -> None:
        """Count a refusal in the cell's metrics (kept by the scheduler, so every replica
        reports the same totals); the count is sent, not awaited."""
        self.client.scheduler.record_error.remote(e.code or e.type)

    # ---- the endpoints ---------------------------------------------------------------
    async def completions(self, body: Any) -> Answer:
        req: CompletionRequest = parse_request(CompletionRequest, body)
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix: not supported by this server; leave it out",
                           param="suffix")
        if not req.prompts:
            raise APIError(400, "prompt: got an empty list; give a prompt", param="prompt")
        prompts = [self._tokenize(p, add_special_tokens=True) for p in req.prompts]
        choices = make_choices(req, prompts, req.max_tokens, req.logprobs,
                               _structured_spec(req), self.client, self.sampling_defaults)
        return await self._respond(req, choices, "cmpl", self.shaper.completion_chunk,
                                   self.shaper.completion_choice)

    async def chat_completions(self, body: Any) -> Answer:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
        self.check_model(req.model)
        tok = self.client.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template; "
                           "use /v1/completions with token ids", param="messages")
        extra = req.chat_template_kwargs or {}
        clash = sorted(set(extra) & {"messages", "add_generation_prompt", "tools",
                                     "continue_final_message"})
        if clash:
            raise APIError(400, f"chat_template_kwargs: {', '.join(clash)} cannot be set "
                           "here; use the request's own fields", param="chat_template_kwargs")
        try:
            messages = [m.as_template_input(f"messages.{i}") for i, m in enumerate(req.messages)]
        except ValueError as e:
            raise APIError.bad_value(e) from None
        text = openai_tokenize.chat_text(tok, messages, req.tool_dicts(), self.tool_parser,
                                         req.add_generation_prompt,
                                         req.continue_final_message, extra)
        prompt = self._tokenize(text, add_special_tokens=False, param="messages")
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true",
                           param="top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
        choices = make_choices(req, [prompt], req.output_limit, logprobs,
                               self._chat_structured(req), self.client,
                               self.sampling_defaults)
        return await self._respond(req, choices, "chatcmpl", self.shaper.chat_chunk,
                                   self.shaper.chat_choice)

    # ---- request handling ------------------------------------------------------------
    def _chat_structured(self, req: ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The chat request's one constraint: its tool choice's or its response format's."""
        spec = _structured_spec(req)
        try:
            forcing = req.tool_forcing(self.tool_parser)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        if forcing is not None and spec is not None:
            raise APIError(400, "tool_choice: forces a tool call, which cannot also follow "
                           "the request's response format / structured output; send one",
                           param="tool_choice")
        return forcing or spec

    def _tokenize(self, prompt: str | list[int], add_special_tokens: bool,
                  param: str = "prompt") -> tuple[str | None, list[int]]:
        try:
            return self.client.tokenize_prompt(prompt, add_special_tokens)
        except ValueError as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else None
            raise APIError(400, f"{param}: {e}", param=param, code=code) from None

    async def _respond(self, req: Any, choices: list[Choice], prefix: str,
                       chunk: Callable[..., list[dict[str, Any]]],
                       final: Callable[[Any, Choice], dict[str, Any]]) -> Answer:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        await open_all(self.client, request_id, choices, req.priority)
        kind = "chat.completion" if prefix == "chatcmpl" else "text_completion"
        if req.stream:
            return Answer(request_id, events=self._sse(req, request_id, choices, kind, chunk))
        try:
            async for _ in progress(request_id, choices):
                pass
        finally:
            await close_all(choices)
        body = envelope(kind, request_id, self.model_name)
        shown = best(choices, req.n) if best_of(req) > req.n else choices
        body["choices"] = [final(req, c) for c in shown]
        if isinstance(req, ChatCompletionRequest) and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(choices[0].prompt_logprobs or [])
        body["usage"] = usage(choices).as_dict()
        return Answer(request_id, body=body)

    async def _sse(self, req: Any, request_id: str, choices: list[Choice], kind: str,
                   chunk: Callable[..., list[dict[str, Any]]]
                   ) -> AsyncIterator[str]:
        """The streamed answer: chunks per choice whenever its text grows, the usage
        chunk if asked for, then ``[DONE]``. A client that goes away cancels this
        generator, which aborts every choice still running."""
        created = int(time.time())
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
        try:
            for c in choices:
                for head in chunk(req, c, first=True):
                    yield sse_event(self._chunk(request_id, chunk_kind, created, req, [head]))
            async for c in progress(request_id, choices):
                for body in chunk(req, c, first=False):
                    yield sse_event(self._chunk(request_id, chunk_kind, created, req, [body]))
            if req.include_usage:
                tail = envelope(chunk_kind, request_id, self.model_name, created)
                tail["choices"] = []
                tail["usage"] = usage(choices).as_dict()
                yield sse_event(tail)
        except Exception as e:
            e = client_error(e, request_id)
            self.count_error(e)
            yield sse_event(e.body())
        finally:
            await close_all(choices)
        yield "data: [DONE]\n\n"

    def _chunk(self, request_id: str, kind: str, created: int, req: Any,
               choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = envelope(kind, request_id, self.model_name, created)
        body["choices"] = choices
        if req.include_usage:
            body["usage"] = None
        return body
