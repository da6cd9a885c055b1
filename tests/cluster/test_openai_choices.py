"""Opening a request's choices: all of them or none, without a cluster."""

from __future__ import annotations

import asyncio

import pytest

from cluster.openai_choices import Choice, open_all
from cluster.openai_protocol import APIError
from scheduler.protocol import SamplingParams


class Stream:
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class Client:
    """Opens the first choice at once; the second waits forever or fails."""

    def __init__(self, second: BaseException | None) -> None:
        self.second = second
        self.opened: list[Stream] = []
        self.waiting = asyncio.Event()

    async def open_stream(self, *args, **kwargs) -> Stream:
        if self.opened:
            if self.second is not None:
                raise self.second
            self.waiting.set()
            await asyncio.Event().wait()
        self.opened.append(Stream())
        return self.opened[-1]


def _choices() -> list[Choice]:
    return [Choice(i, "hi", [1, 2], SamplingParams(max_tokens=2)) for i in range(2)]


def test_a_client_gone_while_opening_cancels_and_closes_what_was_open():
    async def run() -> Client:
        client = Client(second=None)
        task = asyncio.create_task(open_all(client, "cmpl-1", _choices()))
        await client.waiting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):   # not turned into a 500
            await task
        return client

    client = asyncio.run(run())
    assert [s.closed for s in client.opened] == [True]


def test_a_refusal_while_opening_is_the_clients_error_and_closes_what_was_open():
    client = Client(second=ValueError("max_tokens: got 0; allowed range is [1, inf]"))
    with pytest.raises(APIError) as e:
        asyncio.run(open_all(client, "cmpl-1", _choices()))
    assert (e.value.status, e.value.param) == (400, "max_tokens")
    assert [s.closed for s in client.opened] == [True]
