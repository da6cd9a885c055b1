"""The reasoning parsers: whole outputs, and streams that reassemble to the same split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.config import ConfigError, config_from_dict
from cluster.reasoning import ReasoningParser, ReasoningSplit


@pytest.mark.parametrize("kind, text, want", [
    ("qwen3", "<think>\nsteps\n</think>\n\nAnswer.", ReasoningSplit("\nsteps\n", "Answer.")),
    ("qwen3", "No thinking here.", ReasoningSplit(None, "No thinking here.")),
    ("qwen3", "<think>cut off", ReasoningSplit("cut off", "")),
    ("deepseek_r1", "steps</think>answer", ReasoningSplit("steps", "answer")),
    ("deepseek_r1", "<think>steps</think>answer", ReasoningSplit("steps", "answer")),
])
def test_split_of_a_finished_output(kind, text, want):
    assert ReasoningParser(kind).split(text, finished=True) == want


_pieces = st.lists(st.sampled_from(["<", "<th", "ink>", "<think>", "</", "think>", "</think>",
                                    "a", "b c", "\n", " "]), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=_pieces, kind=st.sampled_from(["qwen3", "deepseek_r1"]))
def test_streamed_parts_only_grow_and_end_as_the_whole_split(pieces, kind):
    """What a stream sends is never taken back: each part of every prefix's split is a
    prefix of the same part of the finished split."""
    parser = ReasoningParser(kind)
    text = "".join(pieces)
    final = parser.split(text, finished=True)
    for i in range(len(pieces) + 1):
        part = parser.split("".join(pieces[:i]), finished=False)
        assert (final.reasoning or "").startswith(part.reasoning or "")
        assert final.content.startswith(part.content)


def test_unknown_parser_is_refused_naming_it():
    with pytest.raises(ConfigError, match="serving.reasoning_parser.*qwen3"):
        config_from_dict({"serving": {"reasoning_parser": "qwen"}})
