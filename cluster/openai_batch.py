"""OpenAI Batch API files through the serving path: what ``vllm run-batch`` runs.

Each input line is a request as OpenAI's Batch API takes it: ``{"custom_id", "method":
"POST", "url": "/v1/chat/completions", "/v1/completions" or "/v1/responses", "body"}``.
Each output line is its answer as OpenAI writes it: ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}``. The body runs through the
router's endpoints (``OpenAIServing``, ``responses_api``), so a line gets what the same
request over HTTP gets: a refusal is its status and OpenAI's error body, and it costs
that line only. A file whose lines are not requests (not JSON, no ``custom_id``, a
``custom_id`` twice, another method or url) is refused whole before the cluster starts,
as OpenAI refuses such a file at upload. Lines finish in any order; ``custom_id``
matches an answer to its request.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.batch_store import ResultSink
from cluster.client_errors import client_error
from cluster.openai_protocol import APIError
from cluster.openai_serving import Answer, OpenAIServing
from cluster.responses_api import ResponsesEndpoint

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_FIELDS = {"custom_id", "method", "url", "body"}
Endpoint = Callable[[Any], Awaitable[Answer]]


@dataclass
class BatchRequest:
    """One input line: the request ``body`` for the endpoint at ``url``."""

    custom_id: str
    url: str
    body: dict[str, Any]


def read_requests(path: Path) -> Iterator[BatchRequest]:
    """The file's requests in order; a line that is not one raises a ValueError naming
    the line (``check_requests`` reads them all before a job starts)."""
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield _request(path, number, line)


def check_requests(path: Path) -> int:
    """The number of requests in the file, having checked each line and that no
    ``custom_id`` repeats; a ValueError names the first line that fails."""
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        raise ValueError(f"--input {str(path)!r}: with a .jsonl output (OpenAI Batch API) "
                         "the input is an existing .jsonl file of batch requests")
    seen: set[str] = set()
    for req in read_requests(path):
        if req.custom_id in seen:
            raise ValueError(f"--input {str(path)!r}: the custom_id {req.custom_id!r} "
                             "appears twice; each request needs its own")
        seen.add(req.custom_id)
    return len(seen)


def _request(path: Path, number: int, line: bytes) -> BatchRequest:
    where = f"--input {str(path)!r} line {number}"
    try:
        value = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(value, dict) or "prompt" in value or "messages" in value:
        raise ValueError(f"{where}: expected a batch request, an object with custom_id, "
                         "method, url and body (a file of prompt rows goes to a .parquet "
                         "output)")
    unknown = sorted(set(value) - _FIELDS)
    missing = sorted(_FIELDS - set(value))
    if unknown or missing:
        raise ValueError(f"{where}: fields {unknown or missing} "
                         f"{'are not' if unknown else 'are missing'}; a batch request has "
                         "exactly custom_id, method, url and body")
    custom_id, method, url, body = (value[k] for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"{where}: custom_id: got {custom_id!r}; expected a non-empty string")
    if method != "POST":
        raise ValueError(f"{where}: method: got {method!r}; expected 'POST'")
    if url not in ENDPOINTS:
        raise ValueError(f"{where}: url: got {url!r}; this server runs "
                         f"{' and '.join(ENDPOINTS)}")
    if not isinstance(body, dict):
        raise ValueError(f"{where}: body: got a JSON {type(body).__name__}; expected the "
                         "request object the endpoint takes")
    return BatchRequest(custom_id, url, body)


def output_line(custom_id: str, status: int, request_id: str,
                body: dict[str, Any]) -> dict[str, Any]:
    """An answer as OpenAI's batch output writes it (a refusal too: its status and
    error body; ``error`` is for failures of the batch itself, which a run here has
    none of: it stops instead)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def endpoints(serving: OpenAIServing) -> dict[str, Endpoint]:
    """Each of ``ENDPOINTS``' endpoint, as the router serves it."""
    return {"/v1/chat/completions": serving.chat_completions,
            "/v1/completions": serving.completions,
            "/v1/responses": ResponsesEndpoint(serving).create}


async def answer(endpoint: Endpoint, req: BatchRequest) -> tuple[dict[str, Any], int]:
    """The request's output line and the tokens it generated."""
    request_id = f"batch-{uuid.uuid4().hex}"
    try:
        if req.body.get("stream"):
            raise APIError(400, "stream: a batch request is answered whole; leave stream "
                           "out or set it to false", param="stream")
        got = await endpoint(req.body)
    except Exception as e:
        e = client_error(e, request_id)
        return output_line(req.custom_id, e.status, request_id, e.body()), 0
    usage = got.body["usage"]
    tokens = usage["completion_tokens"] if "completion_tokens" in usage else \
        usage["output_tokens"]   # the Responses API's name
    return output_line(req.custom_id, 200, got.request_id, got.body), tokens


async def run_requests(serving: OpenAIServing, path: Path, done: set[str], sink: ResultSink,
                       window: int) -> None:
    """Answer every request of ``path`` whose ``custom_id`` is not in ``done``, at most
    ``window`` at a time, each output line into ``sink``. Interrupted, the requests in
    flight are cancelled (their streams aborted) and their lines are not written."""
    running: set[asyncio.Task] = set()
    by_url = endpoints(serving)

    async def settle(limit: int) -> None:
        """Wait until at most ``limit`` requests run, writing the lines that finish."""
        nonlocal running
        while len(running) > limit:
            finished, running = await asyncio.wait(running, timeout=sink.flush_s,
                                                   return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                line, tokens = task.result()
                sink.add(line, line["response"]["status_code"] != 200, tokens)
            sink.tick()

    try:
        for req in read_requests(path):
            if req.custom_id in done:
                sink.skip()
                continue
            await settle(window - 1)
            running.add(asyncio.create_task(answer(by_url[req.url], req)))
        await settle(0)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
