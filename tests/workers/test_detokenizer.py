"""Incremental detokenization: complete characters only, same text as a full decode."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from workers.detokenizer import IncrementalDetokenizer
from workers.tokenizer import Tokenizer

TEXT = ("Héllo wörld — naïve café 😀🎉👍🏽 中文测试 日本語 한국어 "
        "the end\n\tÅngström's façade 🇫🇷 ok")


class WindowSpy:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens)


def stream(tokenizer: Tokenizer, prompt: list[int], ids: list[int], step: int = 1,
           skip_special_tokens: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    pieces = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_byte_tokens_never_split_a_character(tiny_tokenizer, step):
    """The tiny vocabulary has no multi-byte merges: every non-ASCII character spans
    several tokens, so most pushes end inside one."""
    tok = tiny_tokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # characters really are split across tokens
    pieces, detok = stream(tok, [], ids, step)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == tok.decode(ids) == TEXT
    assert detok.token_ids == ids


def test_prompt_context_is_not_emitted(tiny_tokenizer):
    tok = tiny_tokenizer()
    prompt = tok.encode("<|im_start|>user\nSay 中文<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode("中文 😀 the")
    pieces, detok = stream(tok, prompt, ids)
    assert "".join(pieces) == "中文 😀 the"
    assert detok.token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tiny_tokenizer, skip):
    tok = tiny_tokenizer()
    ids = tok.encode("the 😀<|im_end|>\n<|im_start|>world<|endoftext|>")
    pieces, _ = stream(tok, [], ids, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is not skip


def test_each_push_decodes_a_bounded_window(tiny_tokenizer):
    tok = tiny_tokenizer()
    ids = tok.encode(TEXT * 20)
    spy = WindowSpy(tok)
    pieces, _ = stream(spy, tok.encode("a prompt of some length"), ids)
    assert "".join(pieces) == TEXT * 20
    assert max(spy.sizes) <= 10  # a 4-byte character plus context, whatever the length


def test_invalid_bytes_are_emitted_after_a_bounded_wait(tiny_tokenizer):
    """A stray lead byte never completes; it must come out as U+FFFD, not stall forever."""
    tok = tiny_tokenizer()
    lead = tok.token_to_id("ð")  # the byte-level symbol of 0xF0, a 4-byte lead byte
    detok = IncrementalDetokenizer(tok, [])
    out = "".join(detok.push([lead]) for _ in range(20)) + detok.flush()
    assert out == tok.decode([lead] * 20) == "\ufffd" * 20
    assert len(detok.text) == 20


def test_flush_emits_an_incomplete_tail(tiny_tokenizer):
    tok = tiny_tokenizer()
    ids = tok.encode("ab😀")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(ids[:-1]) == "ab"  # the emoji's last byte is missing
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_empty_pushes_are_harmless(tiny_tokenizer):
    tok = tiny_tokenizer()
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.push([]) == "" and detok.flush() == "" and detok.text == ""
    assert detok.push(tok.encode("the")) == "the"


@pytest.mark.slow
def test_smollm_stream_matches_full_decode(smollm_tokenizer):
    tok = smollm_tokenizer
    messages = [{"role": "user", "content": "Write in many scripts."}]
    prompt = tok.encode(tok.apply_chat_template(messages))
    ids = tok.encode(TEXT * 3 + "<|im_end|>")
    for skip in (True, False):
        pieces, detok = stream(tok, prompt, ids, skip_special_tokens=skip)
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=skip)
