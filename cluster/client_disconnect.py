"""A client that leaves a stream, as ASGI apps expect to see it under Ray Serve.

When an HTTP client leaves, Serve's proxy cancels the request, and the replica's ASGI
``receive`` raises ``ray.exceptions.TaskCancelledError`` where ASGI has an
``http.disconnect`` message (Serve turns a ``KeyError`` there into that message, not
this). Starlette's ``StreamingResponse`` waits on ``receive`` while it streams, so the
exception escaped the app, and the replica logged a 60-line "Task exception was never
retrieved" traceback for every stream a client left. ``DisconnectOnCancel`` gives the
app the message instead: the stream stops as at any disconnect, its generator closes,
and the request is aborted.
"""

from __future__ import annotations

from ray.exceptions import TaskCancelledError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DISCONNECT: Message = {"type": "http.disconnect"}


class DisconnectOnCancel:
    """ASGI middleware: a cancelled ``receive`` of an HTTP request reads as a disconnect."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except TaskCancelledError:
                return DISCONNECT

        await self.app(scope, receive_or_disconnect, send)
