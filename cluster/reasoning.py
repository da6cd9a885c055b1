"""Reasoning parsers: a model's ``<think>…</think>`` moved out of the answer.

As vLLM's ``--reasoning-parser``: the chat response carries the thinking in
``message.reasoning_content`` (stream deltas: ``delta.reasoning_content``) and only the
answer in ``content``. Two conventions exist: ``qwen3`` (the model writes ``<think>``
itself; output without it is all answer, as with ``enable_thinking: false``) and
``deepseek_r1`` (the chat template opened ``<think>`` in the prompt, so output is
reasoning until ``</think>``).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output has no reasoning part
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: got {self.kind!r}; allowed: "
                             f"{', '.join(REASONING_PARSERS)} (or null for none)")

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        """Reasoning and answer of the output so far. Unfinished output holds back a tail
        that could still become a tag, so streamed text is never taken back."""
        body = text.lstrip()
        if not finished and START.startswith(body):   # "<thi" may become "<think>"
            return ReasoningSplit(None if self.kind == "qwen3" else "", "")
        if body.startswith(START):
            body = body[len(START):]
        elif self.kind == "qwen3":
            return ReasoningSplit(None, text)
        end = body.find(END)
        if end >= 0:
            return ReasoningSplit(body[:end], body[end + len(END):].lstrip("\n"))
        if finished:
            return ReasoningSplit(body, "")
        return ReasoningSplit(body[:len(body) - _partial_tag(body)], "")


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``</think>``."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-n:]):
            return n
    return 0
