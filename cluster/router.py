"""The OpenAI-compatible HTTP front of one cell: the ``Router`` Serve deployment.

Router replicas (FastAPI ingress, autoscaled) attach to the cell's scheduler by name
(``ClusterClient.attach``) and answer each request over HTTP: the completions and chat
endpoints' work (validation, the chat template, choices, response shapes) is
``openai_serving``'s, which the batch job runs too. This module keeps the endpoints,
authorization, body limits and how an answer is sent (JSON or server-sent events).
"""

import hmac
import json
import os
import time
import uuid
from collections.abc import Callable
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
from cluster.openai_protocol import APIError, parse_request
from cluster.openai_serving import Answer, OpenAIServing
from cluster.responses_api import ResponsesEndpoint

API_KEY_ENV = "LLM_CLUSTER_API_KEY"

api = FastAPI(title="llm-cluster", docs_url=None, redoc_url=None)
api.add_middleware(DisconnectOnCancel)


@api.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (unknown path, wrong method) in OpenAI's error shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = (f"{request.method} {request.url.path}: {exc.detail}; the API is "
               "/v1/models, /v1/models/{model}, /v1/completions, /v1/chat/completions, "
               "/v1/responses, /tokenize, /detokenize, /version, /health, /metrics")
    return JSONResponse(APIError(exc.status_code, message, type=kind).body(),
                        status_code=exc.status_code)


# The router's helpers stand before it: ``serve.ingress`` serializes the class as it is
# defined, with the module-level names it finds then.
def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes; this server accepts at most "
                    f"{limit} (serving.max_request_bytes)", code="request_too_large")


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
        self.openai = OpenAIServing(self.client, self.serving, model_name,
                                    info.sampling_defaults)
        self.responses_api = ResponsesEndpoint(self.openai)
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
        return await self._answer(request, self._sender(self.openai.completions))

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, self._sender(self.openai.chat_completions))

    @api.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self._answer(request, self._sender(self.responses_api.create))

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
            self.openai.count_error(e)
            headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
            return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def _sender(self, endpoint: Callable[[Any], Any]) -> Callable[[Request], Any]:
        """A handler that runs ``endpoint`` on the request's body and sends its answer:
        the body as JSON, or the events as a stream."""
        async def send(request: Request) -> Response:
            answer: Answer = await endpoint(await self._body(request))
            headers = {REQUEST_ID_HEADER: answer.request_id}
            if answer.events is not None:
                return StreamingResponse(answer.events, media_type="text/event-stream",
                                         headers=headers)
            return JSONResponse(answer.body, headers=headers)

        return send

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

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "llm-cluster", "root": self.model_root, "parent": None,
                "max_model_len": self.client.max_model_len,
                "sampling_defaults": self.sampling_defaults}

    async def _models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, model: str) -> Response:
        """OpenAI's "retrieve model": the card ``/v1/models`` lists, by its id."""
        self.openai.check_model(model)
        return JSONResponse(self._model_card())

    async def _tokenize_endpoint(self, request: Request) -> Response:
        body = await self._body(request)
        req = parse_request(openai_tokenize.tokenize_request_type(body), body)
        if req.model is not None:
            self.openai.check_model(req.model)
        return JSONResponse(openai_tokenize.tokenize(self.client.tokenizer, req,
                                                     self.client.max_model_len,
                                                     self.openai.tool_parser))

    async def _detokenize_endpoint(self, request: Request) -> Response:
        req: openai_tokenize.DetokenizeRequest = parse_request(
            openai_tokenize.DetokenizeRequest, await self._body(request))
        if req.model is not None:
            self.openai.check_model(req.model)
        return JSONResponse(openai_tokenize.detokenize(self.client.tokenizer, req,
                                                       self.client.vocab_size))

