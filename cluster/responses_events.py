"""The Responses API's output items and the events that build them as an answer streams.

An answer's ``output`` is a list of items: a reasoning item, a message (its text as an
``output_text`` part), function calls. Streamed, each item is announced
(``response.output_item.added``), grows by deltas, and closes
(``response.output_item.done``); every event carries the next ``sequence_number``.
``EventStream`` turns a chat stream's deltas into those events and keeps the items,
from which the final response is built; ``responses_api`` does the rest.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if status == "completed" else []}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


class EventStream:
    """The Responses events of one answer as its output items open, grow and close."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: tuple[str, str, str] | None = None   # (kind, item id, text so far)
        self.calls: dict[int, dict[str, Any]] = {}      # chat call index -> its item

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def text(self, kind: str, delta: str) -> list[str]:
        """``delta`` of the reasoning or the message; opens its item first."""
        events = []
        if self.open is not None and self.open[0] != kind:
            events += self.close_text()
        if self.open is None:
            item_id = new_id("msg" if kind == "content" else "rs")
            self.open = (kind, item_id, "")
            item = message_item(item_id, "", "in_progress") if kind == "content" else \
                {"type": "reasoning", "id": item_id, "summary": [], "content": []}
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.output), item=item))
            if kind == "content":
                events.append(self.event(
                    "response.content_part.added", item_id=item_id,
                    output_index=len(self.output), content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []}))
        kind, item_id, text = self.open
        self.open = (kind, item_id, text + delta)
        name, extra = ("output_text", {"logprobs": []}) if kind == "content" else \
            ("reasoning_text", {})
        if delta:
            events.append(self.event(f"response.{name}.delta", item_id=item_id,
                                     output_index=len(self.output), content_index=0,
                                     delta=delta, **extra))
        return events

    def close_text(self) -> list[str]:
        if self.open is None:
            return []
        kind, item_id, text = self.open
        self.open = None
        index = len(self.output)
        if kind == "content":
            item = message_item(item_id, text)
            part = item["content"][0]
            events = [self.event("response.output_text.done", item_id=item_id,
                                 output_index=index, content_index=0, text=text,
                                 logprobs=[]),
                      self.event("response.content_part.done", item_id=item_id,
                                 output_index=index, content_index=0, part=part)]
        else:
            item = reasoning_item(item_id, text)
            events = [self.event("response.reasoning_text.done", item_id=item_id,
                                 output_index=index, content_index=0, text=text)]
        self.output.append(item)
        return events + [self.event("response.output_item.done", output_index=index,
                                    item=item)]

    def call(self, part: dict[str, Any]) -> list[str]:
        """A chat tool-call delta: its head opens the call's item, its arguments (all of
        them, in one delta) complete it."""
        events = self.close_text()
        index = part["index"]
        if index not in self.calls:
            item = self.calls[index] = call_item(
                {"id": part["id"], "function": {"name": part["function"]["name"],
                                                "arguments": ""}}, "in_progress")
            self.output.append(item)
            return events + [self.event("response.output_item.added",
                                        output_index=len(self.output) - 1, item=item)]
        item = self.calls[index]
        arguments = part["function"]["arguments"]
        item.update(arguments=arguments, status="completed")
        at = self.output.index(item)
        return events + [
            self.event("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=at, delta=arguments),
            self.event("response.function_call_arguments.done", item_id=item["id"],
                       output_index=at, arguments=arguments),
            self.event("response.output_item.done", output_index=at, item=item)]
