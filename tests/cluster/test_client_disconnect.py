"""A client leaving a stream under Ray Serve: ``receive`` raises ``TaskCancelledError``,
which ``DisconnectOnCancel`` turns into the ``http.disconnect`` that Starlette's
streaming response stops on."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import TaskCancelledError
from starlette.responses import StreamingResponse

from cluster.client_disconnect import DisconnectOnCancel

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def _stream_app(closed: list[bool]):
    async def tokens():
        try:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.append(True)

    async def app(scope, receive, send):
        await StreamingResponse(tokens())(scope, receive, send)
    return app


async def _serve_then_leave(app) -> list[dict]:
    """Run ``app`` for one request whose client leaves once a chunk has been sent, the
    way Serve's replica reports it; the messages sent."""
    sent: list[dict] = []
    streaming = asyncio.Event()
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await streaming.wait()
        raise TaskCancelledError()

    async def send(message):
        sent.append(message)
        if message.get("body"):
            streaming.set()

    await asyncio.wait_for(app(SCOPE, receive, send), 10)
    return sent


def test_a_cancelled_receive_ends_the_stream_as_a_disconnect():
    closed: list[bool] = []
    sent = asyncio.run(_serve_then_leave(DisconnectOnCancel(_stream_app(closed))))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert any(m.get("body") for m in sent[1:])
    assert closed == [True]       # the generator closed: the request is aborted there


def test_without_it_the_cancellation_escapes_the_app():
    with pytest.raises(TaskCancelledError):
        asyncio.run(_serve_then_leave(_stream_app([])))


def test_other_scopes_pass_through():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["type"], await receive()))

    async def receive():
        return {"type": "lifespan.startup"}

    asyncio.run(DisconnectOnCancel(app)({"type": "lifespan"}, receive, None))
    assert seen == [("lifespan", {"type": "lifespan.startup"})]
