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
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException

from cluster.cluster_engine import ClusterClient, ClusterEngine, RequestStream
from cluster.config import (
    EngineConfig,
    ServingConfig,
    config_from_dict,
    load_config,
    with_default_pools,
    with_overrides,
)
from cluster.metrics import RouterMetrics
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    chat_logprobs,
    completion_logprobs,
    envelope,
    finish_reason,
    parse_request,
)
from cluster.output_processor import streamable_text
from cluster.outputs import CompletionOutput, RequestOutput
from scheduler.global_scheduler import NoWorkersError, OverloadedError
from scheduler.protocol import SamplingParams
from workers.loading.checkpoint import DEFAULT_MODEL_FILE
from workers.tokenizer import Tokenizer

API_KEY_ENV = "LLM_CLUSTER_API_KEY"
MAX_CHOICES = 128


def served_model_name(config: EngineConfig) -> str:
    """The model id clients send: the configured name, else the checkpoint's."""
    if config.serving.model_name:
        return config.serving.model_name
    path = Path(config.model.path or DEFAULT_MODEL_FILE.split(".")[0])
    return path.name.removesuffix(".gguf")


@dataclass
class CellInfo:
    """What a router needs of its cell to serve it."""

    cluster_name: str
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class LLMCell:
    """Owns one cell for the application's lifetime: its worker actors and scheduler."""

    async def __init__(self, config: dict[str, Any]) -> None:
        self.engine = await asyncio.to_thread(ClusterEngine, config_from_dict(config))

    def describe(self) -> CellInfo:
        e = self.engine
        return CellInfo(e.config.cluster.name, e.tokenizer, e.vocab_size, e.max_model_len)

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
               "/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics")
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
    first_token_at: float | None = None


# The router's helpers stand before it: ``serve.ingress`` serializes the class as it is
# defined, with the module-level names it finds then.
def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _usage(choices: list[_Choice]) -> Usage:
    prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}
    return Usage(sum(prompts.values()), sum(len(c.out.token_ids) for c in choices))


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes; this server accepts at most "
                    f"{limit} (serving.max_request_bytes)", code="request_too_large")


def _scheduler_error(e: BaseException) -> BaseException:
    """The scheduler's refusals as HTTP errors; anything else passes through."""
    if isinstance(e, OverloadedError):
        return APIError(503, str(e), "server_error", code="overloaded", retry_after_s=1)
    if isinstance(e, (NoWorkersError, RayActorError)):
        return APIError(503, f"the cluster cannot serve requests now: {e}", "server_error",
                        code="unavailable", retry_after_s=5)
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return e


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Router:
    """The OpenAI-compatible HTTP front of one cell."""

    async def __init__(self, cell: Any, serving: dict[str, Any], model_name: str) -> None:
        info: CellInfo = await cell.describe.remote()
        self.client = ClusterClient.attach(info.cluster_name, info.tokenizer, info.vocab_size,
                                           info.max_model_len)
        self.serving = ServingConfig(**serving)
        self.api_key = self.serving.api_key or os.environ.get(API_KEY_ENV) or None
        self.model_name = model_name
        self.metrics = RouterMetrics()
        self.created = int(time.time())

    # ---- endpoints -------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> Response:
        try:
            stats = await self.client.astats()
        except Exception as e:
            return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
        alive = len(stats.live())
        if not alive:
            return JSONResponse({"status": "unavailable", "reason": "no live worker"},
                                status_code=503)
        return JSONResponse({"status": "ok", "workers_alive": alive})

    @api.get("/metrics")
    async def metrics(self) -> Response:
        try:
            stats = await self.client.astats()
        except Exception:
            stats = None
        return PlainTextResponse(self.metrics.render(stats),
                                 media_type="text/plain; version=0.0.4")

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
        """Run a handler with authorization, turning every refusal into OpenAI's shape."""
        try:
            self._authorize(request)
            return await handler(request)
        except APIError as e:
            self.metrics.errors[e.code or e.type] += 1
            headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
            return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.api_key}":
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
            "owned_by": "llm-cluster", "max_model_len": self.client.max_model_len}]})

    async def _completions(self, request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await self._body(request))
        self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix: not supported by this server; leave it out", "suffix")
        if not req.prompts:
            raise APIError(400, "prompt: got an empty list; give a prompt", param="prompt")
        prompts = [self._tokenize(p, add_special_tokens=True) for p in req.prompts]
        choices = self._choices(req, prompts, req.max_tokens, req.logprobs)
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
        try:
            text = tok.apply_chat_template([m.as_template_input() for m in req.messages],
                                           add_generation_prompt=True)
        except Exception as e:   # a template's own refusal, e.g. roles out of order
            raise APIError(400, f"messages: the chat template refused them: {e}",
                           param="messages") from None
        prompt = self._tokenize(text, add_special_tokens=False, param="messages")
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
        choices = self._choices(req, [prompt], req.output_limit, logprobs)
        return await self._respond(req, choices, "chatcmpl", self._chat_chunk,
                                   self._chat_choice)

    def _tokenize(self, prompt: str | list[int], add_special_tokens: bool,
                  param: str = "prompt") -> tuple[str | None, list[int]]:
        try:
            return self.client.tokenize_prompt(prompt, add_special_tokens)
        except ValueError as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else None
            raise APIError(400, f"{param}: {e}", param=param, code=code) from None

    def _choices(self, req: Any, prompts: list[tuple[str | None, list[int]]],
                 max_tokens: int | None, logprobs: int | None) -> list[_Choice]:
        """One choice per prompt and sample, each with its own parameters."""
        if not 1 <= req.n <= MAX_CHOICES or len(prompts) * req.n > MAX_CHOICES:
            raise APIError(400, f"n: got {req.n} for {len(prompts)} prompt(s); at most "
                           f"{MAX_CHOICES} choices per request", "n")
        limit = self.client.max_model_len
        choices = []
        for text, ids in prompts:
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise APIError(400, f"this model's context length is {limit} tokens; the "
                               f"prompt has {len(ids)} and max_tokens asks for {max_tokens} "
                               f"more; lower max_tokens to at most {limit - len(ids)}",
                               param="max_tokens", code="context_length_exceeded")
            budget = max_tokens if max_tokens is not None else limit - len(ids)
            params = req.sampling_params(budget, logprobs, req.seed)
            choices += [_Choice(len(choices) + i, text, ids, params, i) for i in range(req.n)]
        return choices

    async def _respond(self, req: Any, choices: list[_Choice], prefix: str,
                       chunk: Callable[..., dict[str, Any] | None],
                       final: Callable[[Any, _Choice], dict[str, Any]]) -> Response:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        arrival = time.perf_counter()
        await self._submit(request_id, choices)
        kind = "chat.completion" if prefix == "chatcmpl" else "text_completion"
        if req.stream:
            return StreamingResponse(
                self._sse(req, request_id, choices, arrival, kind, chunk),
                media_type="text/event-stream")
        self.metrics.in_flight += 1
        try:
            async for _ in self._progress(choices, arrival):
                pass
        finally:
            self.metrics.in_flight -= 1
            await self._close(choices)
        body = envelope(kind, request_id, self.model_name)
        body["choices"] = [final(req, c) for c in choices]
        body["usage"] = _usage(choices).as_dict()
        return JSONResponse(body)

    async def _submit(self, request_id: str, choices: list[_Choice]) -> None:
        """Open every choice's stream, or none: a refusal closes those already open."""
        try:
            for c in choices:
                c.stream = await self.client.open_stream(
                    c.prompt_ids, c.params, c.prompt, f"{request_id}-{c.index}",
                    sample_index=c.sample_index)
        except BaseException as e:
            await self._close(choices)
            raise _scheduler_error(e) from None

    @staticmethod
    async def _close(choices: list[_Choice]) -> None:
        for c in choices:
            if c.stream is not None:
                await c.stream.aclose()

    async def _progress(self, choices: list[_Choice], arrival: float
                        ) -> AsyncIterator[_Choice]:
        """Each choice as its output grows (outputs of all choices interleaved); records
        the latency metrics as each finishes."""
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
                    raise _scheduler_error(item)
                self._absorb(c, item, arrival)
                yield c
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _absorb(self, c: _Choice, out: RequestOutput, arrival: float) -> None:
        now = time.perf_counter()
        c.out = out.outputs[0]
        c.out.index = c.index
        if c.first_token_at is None and c.out.token_ids:
            c.first_token_at = now
        if out.finished:
            self.metrics.requests[finish_reason(c.out) or "abort"] += 1
            self.metrics.observe_request(arrival, c.first_token_at, now, len(c.out.token_ids))

    async def _sse(self, req: Any, request_id: str, choices: list[_Choice], arrival: float,
                   kind: str, chunk: Callable[..., dict[str, Any] | None]
                   ) -> AsyncIterator[str]:
        """The streamed answer: a chunk per choice whenever its text grows, the usage
        chunk if asked for, then ``[DONE]``. A client that goes away cancels this
        generator, which aborts every choice still running."""
        created = int(time.time())
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
        self.metrics.in_flight += 1
        try:
            for c in choices:
                head = chunk(req, c, first=True)
                if head is not None:
                    yield _event(self._chunk(request_id, chunk_kind, created, req, [head]))
            async for c in self._progress(choices, arrival):
                body = chunk(req, c, first=False)
                if body is not None:
                    yield _event(self._chunk(request_id, chunk_kind, created, req, [body]))
            if req.include_usage:
                tail = envelope(chunk_kind, request_id, self.model_name, created)
                tail["choices"] = []
                tail["usage"] = _usage(choices).as_dict()
                yield _event(tail)
        except APIError as e:
            self.metrics.errors[e.code or e.type] += 1
            yield _event(e.body())
        finally:
            self.metrics.in_flight -= 1
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
                          first: bool) -> dict[str, Any] | None:
        if first:
            if not req.echo or c.prompt is None:
                return None
            return {"index": c.index, "text": c.prompt, "logprobs": None,
                    "finish_reason": None}
        new, start, done = self._delta(c)
        if not new and not done:
            return None
        logprobs = completion_logprobs(c.out, start, 0) if c.params.logprobs is not None \
            else None
        return {"index": c.index, "text": new, "logprobs": logprobs,
                "finish_reason": finish_reason(c.out) if done else None}

    def _chat_chunk(self, req: ChatCompletionRequest, c: _Choice,
                    first: bool) -> dict[str, Any] | None:
        if first:
            return {"index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}
        new, start, done = self._delta(c)
        if not new and not done:
            return None
        logprobs = chat_logprobs(c.out, start) if c.params.logprobs is not None else None
        return {"index": c.index, "delta": {"content": new} if new else {},
                "logprobs": logprobs, "finish_reason": finish_reason(c.out) if done else None}

    @staticmethod
    def _completion_choice(req: CompletionRequest, c: _Choice) -> dict[str, Any]:
        head = c.prompt if req.echo and c.prompt is not None else ""
        logprobs = completion_logprobs(c.out, 0, len(head)) \
            if c.params.logprobs is not None else None
        return {"index": c.index, "text": head + c.out.text, "logprobs": logprobs,
                "finish_reason": finish_reason(c.out)}

    @staticmethod
    def _chat_choice(req: ChatCompletionRequest, c: _Choice) -> dict[str, Any]:
        logprobs = chat_logprobs(c.out, 0) if c.params.logprobs is not None else None
        return {"index": c.index, "message": {"role": "assistant", "content": c.out.text},
                "logprobs": logprobs, "finish_reason": finish_reason(c.out)}


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The application for ``serve run cluster.serve_app:build_app config=FILE`` (or a
    Serve config file's ``args``): ``config`` a YAML file, ``model`` overriding its
    model path. A config without worker pools runs 1 prefill + 1 decode worker."""
    args = dict(args or {})
    config = load_config(args.pop("config", None))
    if "model" in args:
        config = with_overrides(config, {("model", "path"): args.pop("model")})
    if args:
        raise ValueError(f"build_app: unknown argument(s) {', '.join(sorted(args))}; "
                         "allowed: config, model")
    return app_for(with_default_pools(config))


def app_for(config: EngineConfig) -> serve.Application:
    """The two deployments for a validated config."""
    sv = config.serving
    cell = LLMCell.bind(dataclasses.asdict(config))
    router = Router.options(
        max_ongoing_requests=sv.max_ongoing_requests,
        autoscaling_config={"min_replicas": sv.min_replicas, "max_replicas": sv.max_replicas,
                            "target_ongoing_requests": sv.target_ongoing_requests})
    return router.bind(cell, dataclasses.asdict(sv), served_model_name(config))
