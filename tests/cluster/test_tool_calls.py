"""The tool-call parsers on hand-written model outputs, the template fallback and the
forcing grammars. Oracles: the texts are written here with their calls known, and the
forcing grammar is checked by llguidance matching texts that must and must not pass."""

from __future__ import annotations

import json

import llguidance
import pytest

from cluster.openai_tools import ToolFields
from cluster.tool_calls import (
    ToolCallParser,
    parser_for_template,
    supports_tools,
    template_messages,
)
from workers.structured_output import grammar_for

HERMES = ToolCallParser("hermes")
LLAMA = ToolCallParser("llama3_json")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def _calls(split):
    return [(c.name, json.loads(c.arguments)) for c in split.calls]


def test_hermes_one_call_with_content_before():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call>'
    split = HERMES.parse(text)
    assert split.content == "Let me look."
    assert _calls(split) == [("get_weather", {"city": "Paris"})]


def test_hermes_two_calls_and_smollm2_list_form():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>[{"name": "get_time", "arguments": {"zone": "CET"}}, '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]</tool_call>')
    split = HERMES.parse(text)
    assert split.content is None
    assert _calls(split) == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"}),
                             ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in split.calls}) == 3


def test_hermes_unclosed_last_call_still_parses():
    split = HERMES.parse('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert _calls(split) == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>',
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
    '<tool_call>"just a string"</tool_call>',
])
def test_hermes_text_without_a_valid_call_is_content(text):
    split = HERMES.parse(text)
    assert split.content == text and split.calls == []


def test_llama3_json_calls():
    split = LLAMA.parse(' {"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert split.content is None and _calls(split) == [("get_weather", {"city": "Rome"})]
    split = LLAMA.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "A"}}; '
                        '{"name": "get_time", "parameters": {"zone": "B"}}')
    assert _calls(split) == [("get_time", {"zone": "A"}), ("get_time", {"zone": "B"})]


@pytest.mark.parametrize("text", [
    "Rome is sunny today.",
    '{"name": "get_weather", "parameters": {"city": "Rome"',
    '{"name": "get_weather", "parameters": {"city": "Rome"}} and then some words',
    '{"city": "Rome"}',
])
def test_llama3_text_without_a_valid_call_is_content(text):
    split = LLAMA.parse(text)
    assert split.content == text and split.calls == []


def test_streamable_content_never_runs_into_a_call():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    final = HERMES.parse(text + "\n</tool_call>").content
    for n in range(len(text) + 1):
        streamed = HERMES.streamable_content(text[:n])
        assert final.startswith(streamed), (n, streamed)
        assert "<" not in streamed
    assert HERMES.streamable_content("Hello <tool") == "Hello"
    assert HERMES.streamable_content("a < b") == "a < b"
    assert LLAMA.streamable_content('  {"name"') == ""
    assert LLAMA.streamable_content("<|python") == ""
    assert LLAMA.streamable_content("Hi there") == "Hi there"


def test_parser_from_template():
    qwen = "{% if tools %}<tools>{{ tools }}</tools> <tool_call> {% endif %}"
    llama = ("{% if tools %}Respond with {\"name\": function name, \"parameters\": ...}"
             "{% endif %}{% if message.role == 'ipython' %}{% endif %}")
    assert parser_for_template(qwen) == "hermes"
    assert parser_for_template(llama) == "llama3_json"
    assert parser_for_template(None) == "hermes"
    assert supports_tools(qwen) and not supports_tools("{{ messages }}")
    with pytest.raises(ValueError, match="tool_call_parser: got 'mistral'"):
        ToolCallParser("mistral")


def test_template_without_tools_gets_them_as_a_system_message_and_calls_as_text():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out = template_messages(messages, [WEATHER], "{{ messages }}", HERMES)
    assert out[0]["role"] == "system" and json.dumps(WEATHER) in out[0]["content"]
    written = out[2]["content"]
    assert HERMES.parse(written).calls[0].name == "get_weather"
    assert json.loads(HERMES.parse(written).calls[0].arguments) == {"city": "Paris"}
    assert out[3] == messages[2]
    assert template_messages(messages, [WEATHER], "{% if tools %}{% endif %}", HERMES) \
        == messages


def _accepts(spec, text: str) -> bool:
    """Whether the forcing grammar accepts ``text`` entirely (byte-level check)."""
    grammar = grammar_for(spec)
    tok = llguidance.LLTokenizer(_byte_tokenizer_json(), n_vocab=257, eos_token=256)
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    ok = m.consume_tokens(list(text.encode()))
    return ok and m.is_accepting()


def _byte_tokenizer_json() -> str:
    """A tokenizer of the 256 byte tokens (id = byte) and an end token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_unicode_order())}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet())
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|end|>"])
    return t.to_str()


def _unicode_order() -> list[str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def test_forcing_grammar_accepts_only_a_valid_call_of_the_named_function():
    fields = ToolFields.model_validate({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    spec = fields.tool_forcing(HERMES)
    assert _accepts(spec, '<tool_call>\n{"name": "get_weather", "arguments": '
                          '{"city": "Paris"}}\n</tool_call>')
    assert not _accepts(spec, '<tool_call>\n{"name": "get_time", "arguments": '
                              '{"zone": "UTC"}}\n</tool_call>')
    assert not _accepts(spec, '<tool_call>\n{"name": "get_weather", "arguments": '
                              '{"town": "Paris"}}\n</tool_call>')
    required = ToolFields.model_validate({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert _accepts(required.tool_forcing(HERMES), '<tool_call>\n{"name": "get_time", '
                    '"arguments": {"zone": "UTC"}}\n</tool_call>')
    assert _accepts(required.tool_forcing(LLAMA),
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert ToolFields.model_validate({"tools": [WEATHER], "tool_choice": "none"}) \
        .tool_forcing(HERMES) is None
    assert ToolFields.model_validate({"tools": [WEATHER]}).tool_forcing(HERMES) is None


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "tool_choice: 'required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice: names 'x', which is not among the tools"),
])
def test_unmeetable_tool_choice_is_refused_naming_it(body, message):
    with pytest.raises(ValueError, match=message):
        ToolFields.model_validate(body).tool_forcing(HERMES)
