"""The OpenAI-compatible HTTP front of one cell: the ``Router`` Serve deployment.

Router replicas (FastAPI ingress, autoscaled) validate requests, apply the chat
template, tokenize, attach to the cell's scheduler by name (``ClusterClient.attach``)
and stream tokens back. A request with ``n`` choices (or several prompts) runs as one
stream per choice (``openai_choices``); how each is shown is ``openai_responses``'.
This module keeps the endpoints, authorization, body limits and the request flow.
"""

import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from cluster import metrics, openai_tokenize, readiness
from cluster.cell_deployment import CellInfo
from cluster.client_disconnect import DisconnectOnCancel
from cluster.client_errors import REQUEST_ID_HEADER, client_error, unavailable
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

API_KEY_ENV = "LLM_CLUSTER_API_KEY"

api = FastAPI(title="llm-cluster", docs_url=None, redoc_url=None)
api.add_middleware(DisconnectOnCancel)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (unknown path, wrong method) in OpenAI's error shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = (f"{request.method} {request.url.path}: {exc.detail}; the API is "
               "/v1/models, /v1/models/{model}, /v1/completions, /v1/chat/completions, "
               "/tokenize, /detokenize, /version, /health, /metrics")
    return JSONResponse(APIError(exc.status_code, message, type=kind).body(),
                        status_code=exc.status_code)


# The router's helpers stand before it: ``serve.ingress`` serializes the class as it is
# defined, with the module-level names it finds then.
def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes; this server accepts at most "
                    f"{limit} (serving.max_request_bytes)", code="request_too_large")


def _structured_spec(req: Any) -> StructuredOutputsParams | None:
    try:
        return req.structured_spec()
    except ValueError as e:
        raise APIError.bad_value(e) from None


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Router:
    """The OpenAI-compatible HTTP front of one cell."""

    async def __init__(self, cell: Any, serving: dict[str, Any], model_name: str,
                       model_root: str) -> None:
        info: CellInfo = await cell.describe.remote()
        self.client = ClusterClient.attach(info.cluster_name, info.tokenizer, info.vocab_size,
                                           info.max_model_len)
        self.serving = ServingConfig(**serving)
        self.api_key = self.serving.api_key or os.environ.get(API_KEY_ENV) or None
        self.model_name = model_name
        self.sampling_defaults = info.sampling_defaults
        self.model_root = model_root
        template = info.tokenizer.template_for(True) if info.tokenizer is not None else None
        self.tool_parser = ToolCallParser(self.serving.tool_call_parser
                                          or parser_for_template(template))
        reasoning = (ReasoningParser(self.serving.reasoning_parser)
                     if self.serving.reasoning_parser else None)
        self.shaper = ResponseShaper(reasoning, self.tool_parser, info.tokenizer)
        self.created = int(time.time())

    # ---- endpoints -------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> Response:
        status, body = await readiness.health(self.client)
        return JSONResponse(body, status_code=status)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        try:
            stats = await self.client.astats()
        except Exception as e:
            return PlainTextResponse(unavailable("/metrics", e) + "\n", status_code=503)
        return Response(metrics.render(stats, self.model_name),
                        media_type=metrics.CONTENT_TYPE)

    @api.get("/version")
    async def version(self) -> Response:
        return JSONResponse(openai_tokenize.version())

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, self._tokenize_endpoint)

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, self._detokenize_endpoint)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._answer(request, self._models)

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request) -> Response:
        return await self._answer(request, lambda _: self._model(model))

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._answer(request, self._completions)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, self._chat_completions)

    # ---- request handling ------------------------------------------------------------
    async def _answer(self, request: Request,
                      handler: Callable[[Request], Any]) -> Response:
        """Run a handler with authorization, turning every refusal and failure into
        OpenAI's shape (a failure's details go to the log, see ``client_errors``)."""
        try:
            self._authorize(request)
            return await handler(request)
        except Exception as e:
            e = client_error(e, f"err-{uuid.uuid4().hex}")
            self._count_error(e)
            headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
            return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def _count_error(self, e: APIError) -> None:
        """Count a refusal in the cell's metrics (kept by the scheduler, so every replica
        reports the same totals); the count is sent, not awaited."""
        self.client.scheduler.record_error.remote(e.code or e.type)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        # Constant time: how long a wrong key takes says nothing of how much of it matched.
        if not hmac.compare_digest(header.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header "
                           "'Authorization: Bearer <key>'", type="authentication_error",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        """The JSON body, refusing one over the size limit before reading it all."""
        limit = self.serving.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r} (see GET /v1/models)", type="not_found_error",
                           param="model", code="model_not_found")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "llm-cluster", "root": self.model_root, "parent": None,
                "max_model_len": self.client.max_model_len,
                "sampling_defaults": self.sampling_defaults}

    async def _models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, model: str) -> Response:
        """OpenAI's "retrieve model": the card ``/v1/models`` lists, by its id."""
        self._check_model(model)
        return JSONResponse(self._model_card())

    async def _tokenize_endpoint(self, request: Request) -> Response:
        body = await self._body(request)
        req = parse_request(openai_tokenize.tokenize_request_type(body), body)
        if req.model is not None:
            self._check_model(req.model)
        return JSONResponse(openai_tokenize.tokenize(self.client.tokenizer, req,
                                                     self.client.max_model_len,
                                                     self.tool_parser))

    async def _detokenize_endpoint(self, request: Request) -> Response:
        req: openai_tokenize.DetokenizeRequest = parse_request(
            openai_tokenize.DetokenizeRequest, await self._body(request))
        if req.model is not None:
            self._check_model(req.model)
        return JSONResponse(openai_tokenize.detokenize(self.client.tokenizer, req,
                                                       self.client.vocab_size))

    async def _completions(self, request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await self._body(request))
        self._check_model(req.model)
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

    async def _chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest,
                                                   await self._body(request))
        self._check_model(req.model)
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
                       final: Callable[[Any, Choice], dict[str, Any]]) -> Response:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        await open_all(self.client, request_id, choices, req.priority)
        kind = "chat.completion" if prefix == "chatcmpl" else "text_completion"
        headers = {REQUEST_ID_HEADER: request_id}
        if req.stream:
            return StreamingResponse(self._sse(req, request_id, choices, kind, chunk),
                                     media_type="text/event-stream", headers=headers)
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
        return JSONResponse(body, headers=headers)

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
            self._count_error(e)
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
