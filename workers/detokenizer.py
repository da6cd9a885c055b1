"""Streaming token ids -> text without splitting characters and without O(n) decodes.

A token can end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK
into byte tokens), and some tokenizers decode a token differently depending on what
precedes it (SentencePiece drops a leading space at the start of a text). So each step
decodes a short window twice: ``ids[prefix:read]`` (text already emitted, for context)
and ``ids[prefix:]``; the difference is new text, emitted only once it does not end in
U+FFFD, the replacement character a decoder produces for an incomplete character.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Tokens of prompt kept as decoding context for the first output tokens.
_PROMPT_CONTEXT = 5
# Text still incomplete after this many held tokens holds a genuine U+FFFD (bytes that
# never form a character): emit it rather than let the window, and each step's cost, grow.
_MAX_HELD = 8


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._num_context = len(context)
        self._ids = context  # context + output ids
        self._prefix = 0  # window start: tokens decoded only for context
        self._read = len(context)  # tokens before this index are already emitted
        self._pieces: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        """New text since the last call; never ends inside a multi-byte character."""
        self._ids.extend(token_ids)
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        # A character has at most 4 bytes, so at most the last 3 tokens can hold an
        # incomplete one: emit up to the longest end that decodes to complete text.
        for end in range(len(self._ids), max(self._read, len(self._ids) - 4), -1):
            text = self._decode(self._prefix, end)
            if not text.endswith(_REPLACEMENT):
                return self._emit(text[len(prefix_text):], end)
        if len(self._ids) - self._read > _MAX_HELD:
            return self.flush()
        return ""

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back, complete or not."""
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        return self._emit(self._decode(self._prefix, len(self._ids))[len(prefix_text):],
                          len(self._ids))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """Output token ids pushed so far (without the prompt)."""
        return self._ids[self._num_context:]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], self._skip_special)

    def _emit(self, piece: str, end: int) -> str:
        """Output ``piece``, the text of the tokens up to ``end``."""
        self._prefix = self._read
        self._read = end
        if piece:
            self._pieces.append(piece)
        return piece
