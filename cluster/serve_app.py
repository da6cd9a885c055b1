"""The Ray Serve application: an OpenAI-compatible router in front of one cell.

Two deployments. ``LLMCell`` (one replica) launches the cell, the worker actors and
the global scheduler, and keeps them for the application's lifetime; ``Router``
(FastAPI ingress, autoscaled) validates requests, applies the chat template,
tokenizes, attaches to the cell's scheduler by name and streams tokens back. A
request with ``n`` choices (or several prompts) runs as one stream per choice: choice
k of a prompt is its sample index k under the request's seed, as everywhere else.
``build_app`` is the import path for ``serve run`` and the CLI's ``serve``.
"""

import asyncio
import dataclasses
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from cluster import metrics, openai_tokenize, readiness
from cluster.client_errors import REQUEST_ID_HEADER, client_error, unavailable
from cluster.cluster_client import ClusterClient, RequestStream
from cluster.cluster_engine import ClusterEngine
from cluster.config import (
    ConfigError,
    EngineConfig,
    ServingConfig,
    config_from_dict,
    load_config,
    with_default_pools,
    with_overrides,
)
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    envelope,
    finish_reason,
    parse_request,
    prompt_logprobs_json,
    stop_reason,
)
from cluster.output_processor import streamable_text
from cluster.outputs import CompletionOutput, Logprob
from cluster.reasoning import ReasoningParser
from cluster.tool_calls import ToolCallParser, ToolCallSplit, parser_for_template, template_messages
from scheduler.protocol import SamplingParams, StructuredOutputsParams
from workers.loading.checkpoint import DEFAULT_MODEL_FILE
from workers.loading.hub import is_hub_id
from workers.tokenizer import Tokenizer

API_KEY_ENV = "LLM_CLUSTER_API_KEY"
MAX_CHOICES = 128


def served_model_name(config: EngineConfig) -> str:
    """The model id clients send: the configured name, else the checkpoint's."""
    if config.serving.model_name:
        return config.serving.model_name
    if config.model.path and is_hub_id(config.model.path):
        return config.model.path   # vLLM serves a model id under that id
    path = Path(config.model.path or DEFAULT_MODEL_FILE.split(".")[0])
    return path.name.removesuffix(".gguf")


@dataclass
class CellInfo:
    """What a router needs of its cell to serve it."""

    cluster_name: str
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    sampling_defaults: dict[str, float | int]


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class LLMCell:
    """Owns one cell for the application's lifetime: its worker actors and scheduler,
    which outlive this replica's process: restarted by Serve, it adopts them."""

    async def __init__(self, config: dict[str, Any]) -> None:
        self.engine = await asyncio.to_thread(ClusterEngine, config_from_dict(config),
                                              survive_owner=True)

    def describe(self) -> CellInfo:
        e = self.engine
        return CellInfo(e.config.cluster.name, e.tokenizer, e.vocab_size, e.max_model_len,
                        e.sampling_defaults)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


api = FastAPI(title="llm-cluster", docs_url=None, redoc_url=None)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (unknown path, wrong method) in OpenAI's error shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = (f"{request.method} {request.url.path}: {exc.detail}; the API is "
               "/v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, "
               "/version, /health, /metrics")
    return JSONResponse(APIError(exc.status_code, message, kind).body(),
                        status_code=exc.status_code)


@dataclass
class _Choice:
    """One choice of a request: one scheduler request and what has been sent of it."""

    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    sample_index: int = 0   # which of its prompt's choices
    stream: RequestStream | None = None
    out: CompletionOutput = field(default_factory=lambda: CompletionOutput(0))
    sent_text: int = 0
    sent_tokens: int = 0
    sent_reasoning: int = 0   # with a reasoning parser: what of each part has been sent
    sent_content: int = 0
    hide_logprobs: bool = False   # asked for only to rank best_of samples
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # its prompt's
    calls_sent: bool = False   # with tool calls expected: their deltas went out

    @property
    def logprobs(self) -> bool:
        """Whether the answer shows this choice's logprobs."""
        return self.params.logprobs is not None and not self.hide_logprobs


# The router's helpers stand before it: ``serve.ingress`` serializes the class as it is
# defined, with the module-level names it finds then.
def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _usage(choices: list[_Choice]) -> Usage:
    prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}
    return Usage(sum(prompts.values()), sum(len(c.out.token_ids) for c in choices))


def _best_of(req: Any) -> int:
    """Samples to draw per prompt: ``best_of`` (completions only; at least ``n``, not
    streamed, as OpenAI has it), else ``n``."""
    best_of = req.best_of if isinstance(req, CompletionRequest) else None
    if best_of is None:
        return req.n
    if best_of < req.n:
        raise APIError(400, f"best_of: got {best_of}, fewer than n={req.n}; best_of must be "
                       ">= n", param="best_of")
    if req.stream and best_of > req.n:
        raise APIError(400, "best_of: cannot be streamed (the best samples are known only "
                       "at the end); set stream to false or best_of to n", param="best_of")
    return best_of


def _best(choices: list[_Choice], n: int) -> list[_Choice]:
    """The ``n`` samples of each prompt with the highest cumulative logprob (best_of),
    in that order, renumbered."""
    by_prompt: dict[int, list[_Choice]] = {}
    for c in choices:
        by_prompt.setdefault(id(c.prompt_ids), []).append(c)
    best = [c for group in by_prompt.values()
            for c in sorted(group, key=lambda c: -(c.out.cumulative_logprob or 0.0))[:n]]
    for i, c in enumerate(best):
        c.index = c.out.index = i
    return best


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes; this server accepts at most "
                    f"{limit} (serving.max_request_bytes)", code="request_too_large")


def _structured_spec(req: Any) -> StructuredOutputsParams | None:
    try:
        return req.structured_spec()
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from None


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
        self.reasoning = (ReasoningParser(self.serving.reasoning_parser)
                          if self.serving.reasoning_parser else None)
        self.model_root = model_root
        template = info.tokenizer.template_for(True) if info.tokenizer is not None else None
        self.tool_parser = ToolCallParser(self.serving.tool_call_parser
                                          or parser_for_template(template))
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
                           "'Authorization: Bearer <key>'", "authentication_error",
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
                           f"{self.model_name!r} (see GET /v1/models)", "not_found_error",
                           "model", "model_not_found")

    async def _models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "llm-cluster", "root": self.model_root, "parent": None,
            "max_model_len": self.client.max_model_len,
            "sampling_defaults": self.sampling_defaults}]})

    async def _tokenize_endpoint(self, request: Request) -> Response:
        body = await self._body(request)
        req = parse_request(openai_tokenize.tokenize_request_type(body), body)
        if req.model is not None:
            self._check_model(req.model)
        return JSONResponse(openai_tokenize.tokenize(self.client.tokenizer, req,
                                                     self.client.max_model_len))

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
            raise APIError(400, "suffix: not supported by this server; leave it out", "suffix")
        if not req.prompts:
            raise APIError(400, "prompt: got an empty list; give a prompt", param="prompt")
        prompts = [self._tokenize(p, add_special_tokens=True) for p in req.prompts]
        choices = self._choices(req, prompts, req.max_tokens, req.logprobs,
                                _structured_spec(req))
        return await self._respond(req, choices, "cmpl", self._completion_chunk,
                                   self._completion_choice)

    async def _chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest,
                                                   await self._body(request))
        self._check_model(req.model)
        tok = self.client.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer, so it has no chat template; "
                           "use /v1/completions with token ids", "messages")
        extra = req.chat_template_kwargs or {}
        clash = sorted(set(extra) & {"messages", "add_generation_prompt", "tools"})
        if clash:
            raise APIError(400, f"chat_template_kwargs: {', '.join(clash)} cannot be set "
                           "here; use the request's own fields", param="chat_template_kwargs")
        try:
            messages = [m.as_template_input(f"messages.{i}") for i, m in enumerate(req.messages)]
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":", 1)[0]) from None
        tools = req.tool_dicts()
        messages = template_messages(messages, tools, tok.template_for(bool(tools)),
                                     self.tool_parser)
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                           **extra)
        except Exception as e:   # a template's own refusal, e.g. roles out of order
            raise APIError(400, f"messages: the chat template refused them: {e}",
                           param="messages") from None
        prompt = self._tokenize(text, add_special_tokens=False, param="messages")
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
        choices = self._choices(req, [prompt], req.output_limit, logprobs,
                                self._chat_structured(req))
        return await self._respond(req, choices, "chatcmpl", self._chat_chunk,
                                   self._chat_choice)

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

    def _choices(self, req: Any, prompts: list[tuple[str | None, list[int]]],
                 max_tokens: int | None, logprobs: int | None,
                 structured: StructuredOutputsParams | None) -> list[_Choice]:
        """One choice per prompt and sample, each with its own parameters: ``n`` samples a
        prompt, or ``best_of`` to keep the best ``n`` of (ranked by their logprobs, which
        are then asked for and shown only if the request wanted them)."""
        if not 1 <= req.n <= MAX_CHOICES or len(prompts) * req.n > MAX_CHOICES:
            raise APIError(400, f"n: got {req.n} for {len(prompts)} prompt(s); at most "
                           f"{MAX_CHOICES} choices per request", "n")
        samples = _best_of(req)
        if len(prompts) * samples > MAX_CHOICES:
            raise APIError(400, f"best_of: got {samples} for {len(prompts)} prompt(s); at "
                           f"most {MAX_CHOICES} samples per request", param="best_of")
        hide = samples > req.n and logprobs is None
        if hide:
            logprobs = 0
        if req.stream and req.wanted_prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs (or echo with logprobs): not supported with "
                           "stream; set stream to false", param="prompt_logprobs")
        bad = [t for t in req.sampling_params(None, None, None).logit_bias
               if t >= self.client.vocab_size]
        if bad:
            raise APIError(400, f"logit_bias: got the token id {bad[0]}; this model's ids "
                           f"lie in [0, {self.client.vocab_size})", param="logit_bias")
        limit = self.client.max_model_len
        choices = []
        for text, ids in prompts:
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise APIError(400, f"this model's context length is {limit} tokens; the "
                               f"prompt has {len(ids)} and max_tokens asks for {max_tokens} "
                               f"more; lower max_tokens to at most {limit - len(ids)}",
                               param="max_tokens", code="context_length_exceeded")
            budget = max_tokens if max_tokens is not None else limit - len(ids)
            params = req.sampling_params(budget, logprobs, req.seed, self.sampling_defaults,
                                         structured)
            for i in range(samples):
                if i:   # a prompt's logprobs are computed once, by its first sample
                    params = dataclasses.replace(params, prompt_logprobs=None)
                choices.append(_Choice(len(choices), text, ids, params, i, hide_logprobs=hide))
        return choices

    async def _respond(self, req: Any, choices: list[_Choice], prefix: str,
                       chunk: Callable[..., list[dict[str, Any]]],
                       final: Callable[[Any, _Choice], dict[str, Any]]) -> Response:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        await self._submit(request_id, choices)
        kind = "chat.completion" if prefix == "chatcmpl" else "text_completion"
        headers = {REQUEST_ID_HEADER: request_id}
        if req.stream:
            return StreamingResponse(self._sse(req, request_id, choices, kind, chunk),
                                     media_type="text/event-stream", headers=headers)
        try:
            async for _ in self._progress(request_id, choices):
                pass
        finally:
            await self._close(choices)
        body = envelope(kind, request_id, self.model_name)
        shown = _best(choices, req.n) if _best_of(req) > req.n else choices
        body["choices"] = [final(req, c) for c in shown]
        if isinstance(req, ChatCompletionRequest) and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(choices[0].prompt_logprobs or [])
        body["usage"] = _usage(choices).as_dict()
        return JSONResponse(body, headers=headers)

    async def _submit(self, request_id: str, choices: list[_Choice]) -> None:
        """Open every choice's stream, or none: a refusal closes those already open."""
        try:
            for c in choices:
                c.stream = await self.client.open_stream(
                    c.prompt_ids, c.params, c.prompt, f"{request_id}-{c.index}",
                    sample_index=c.sample_index)
        except BaseException as e:
            await self._close(choices)
            raise client_error(e, request_id) from None

    @staticmethod
    async def _close(choices: list[_Choice]) -> None:
        for c in choices:
            if c.stream is not None:
                await c.stream.aclose()

    async def _progress(self, request_id: str, choices: list[_Choice]
                        ) -> AsyncIterator[_Choice]:
        """Each choice as its output grows (outputs of all choices interleaved); a
        failure is raised as the client sees it."""
        queue: asyncio.Queue = asyncio.Queue()

        async def follow(c: _Choice) -> None:
            try:
                async for out in c.stream:
                    await queue.put((c, out))
            except BaseException as e:
                await queue.put((c, e))
                raise
            finally:
                await queue.put((c, None))

        tasks = [asyncio.create_task(follow(c)) for c in choices]
        try:
            running = len(tasks)
            while running:
                c, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise client_error(item, request_id)
                c.out = item.outputs[0]
                c.out.index = c.index
                if item.prompt_logprobs is not None:
                    for sibling in choices:
                        if sibling.prompt_ids is c.prompt_ids:
                            sibling.prompt_logprobs = item.prompt_logprobs
                yield c
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sse(self, req: Any, request_id: str, choices: list[_Choice], kind: str,
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
                    yield _event(self._chunk(request_id, chunk_kind, created, req, [head]))
            async for c in self._progress(request_id, choices):
                for body in chunk(req, c, first=False):
                    yield _event(self._chunk(request_id, chunk_kind, created, req, [body]))
            if req.include_usage:
                tail = envelope(chunk_kind, request_id, self.model_name, created)
                tail["choices"] = []
                tail["usage"] = _usage(choices).as_dict()
                yield _event(tail)
        except Exception as e:
            e = client_error(e, request_id)
            self._count_error(e)
            yield _event(e.body())
        finally:
            await self._close(choices)
        yield "data: [DONE]\n\n"

    def _chunk(self, request_id: str, kind: str, created: int, req: Any,
               choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = envelope(kind, request_id, self.model_name, created)
        body["choices"] = choices
        if req.include_usage:
            body["usage"] = None
        return body

    # ---- the two endpoints' shapes ---------------------------------------------------
    @staticmethod
    def _delta(c: _Choice) -> tuple[str, int, bool]:
        """New streamable text and the first unsent token; marks them sent."""
        text = streamable_text(c.out, c.params.stop)
        new, start = text[c.sent_text:], c.sent_tokens
        c.sent_text, c.sent_tokens = len(text), len(c.out.token_ids)
        return new, start, c.out.finished

    def _completion_chunk(self, req: CompletionRequest, c: _Choice,
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

    def _chat_chunk(self, req: ChatCompletionRequest, c: _Choice,
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
        split = self.tool_parser.parse(content)
        return reasoning, split.content, split

    def _completion_choice(self, req: CompletionRequest, c: _Choice) -> dict[str, Any]:
        head = c.prompt if req.echo and c.prompt is not None else ""
        logprobs = completion_logprobs(c.out, 0, len(head)) \
            if c.logprobs else None
        if logprobs is not None and req.echo and c.prompt_logprobs is not None:
            tok = self.client.tokenizer
            first = tok.decode(c.prompt_ids[:1], skip_special_tokens=False) if tok else ""
            echoed = echo_logprobs(c.prompt_ids, c.prompt_logprobs, first)
            logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
        choice = {"index": c.index, "text": head + c.out.text, "logprobs": logprobs,
                  "finish_reason": finish_reason(c.out), "stop_reason": stop_reason(c.out)}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs or [])
        return choice

    def _chat_choice(self, req: ChatCompletionRequest, c: _Choice) -> dict[str, Any]:
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


def config_from_args(args: dict[str, Any] | None) -> EngineConfig:
    """The validated config an application's ``args`` name: ``config`` a YAML file or the
    config itself as a mapping (how a Serve config file carries it inline, as the Helm
    chart's ``serveConfigV2`` does: a pod needs no config file), ``model`` overriding its
    model path. A config without worker pools runs 1 prefill + 1 decode worker."""
    args = dict(args or {})
    source = args.pop("config", None)
    if isinstance(source, dict):
        config = config_from_dict(source)
    elif source is None or isinstance(source, str):
        config = load_config(source)
    else:
        raise ConfigError(f"build_app: config: got {source!r}; expected a YAML file path "
                          "or the config as a mapping of sections (model, cache, ...)")
    if "model" in args:
        config = with_overrides(config, {("model", "path"): args.pop("model")})
    if args:
        raise ConfigError(f"build_app: unknown argument(s) {', '.join(sorted(args))}; "
                          "allowed: config, model")
    return with_default_pools(config)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The application for ``serve run cluster.serve_app:build_app config=FILE`` or a
    Serve config file's ``args`` (see ``config_from_args``)."""
    return app_for(config_from_args(args))


def app_for(config: EngineConfig) -> serve.Application:
    """The two deployments for a validated config."""
    sv = config.serving
    cell = LLMCell.bind(dataclasses.asdict(config))
    router = Router.options(
        max_ongoing_requests=sv.max_ongoing_requests,
        autoscaling_config={"min_replicas": sv.min_replicas, "max_replicas": sv.max_replicas,
                            "target_ongoing_requests": sv.target_ongoing_requests})
    root = config.model.path or Path(DEFAULT_MODEL_FILE).name
    return router.bind(cell, dataclasses.asdict(sv), served_model_name(config), root)
