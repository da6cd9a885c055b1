"""Tokenizer and chat templates against HF transformers on the same files."""

from __future__ import annotations

import logging

import pytest

from workers.chat_template import render_chat_template
from workers.loading.gguf_tokenizer import convert_gguf_tokenizer
from workers.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# No digits: HF's GGUF converter ignores tokenizer.ggml.pre, so digits are checked
# against llama.cpp's "smollm" rule separately.
TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** two  # square\n\n\nclass A:\n\tpass",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦.",
    "中文测试，日本語のテキスト、한국어 텍스트.",
    "Accents: café, naïve, Ångström, façade, jalapeño.",
    "   leading and trailing spaces   ",
    "tabs\t\tand\nnew\n\n\nlines\r\n",
    "<|im_start|>user\nWhat is this?<|im_end|>\n<|im_start|>assistant\n",
    "Text with <|endoftext|> in the middle and <repo_name> too.",
    "It's, you're, they'll, I'd, we've, she'S, DON'T.",
    "URL: https://example.com/path?query=value&x=y#frag",
    "",
    " ",
    "\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "Why did the chicken cross the road?"},
     {"role": "user", "content": "Why? 🤔"}],
    [{"role": "system", "content": "Système: réponds en français."},
     {"role": "user", "content": "Bonjour\n\nça va ?"},
     {"role": "assistant", "content": "Oui !"}],
]


# --- the default model (SmolLM2 GGUF) against HF's GGUF tokenizer --------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(smollm_tokenizer, hf_gguf_tokenizer, text):
    expected = hf_gguf_tokenizer(text, add_special_tokens=True).input_ids
    assert smollm_tokenizer.encode(text) == expected
    assert smollm_tokenizer.encode(text, add_special_tokens=False) == expected


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf_and_round_trips(smollm_tokenizer, hf_gguf_tokenizer, text):
    ids = smollm_tokenizer.encode(text)
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert (smollm_tokenizer.decode(ids, skip_special_tokens=skip)
                == hf_gguf_tokenizer.decode(ids, skip_special_tokens=skip))


@pytest.mark.slow
@pytest.mark.parametrize("text, digits", [
    ("2024", "2024"),
    ("In 1984, 42 people", "1984"),
    ("x=31415926535", "31415926535"),
])
def test_digits_are_single_tokens_like_llama_cpp_smollm(smollm_tokenizer, text, digits):
    """llama.cpp's "smollm" pre-tokenizer isolates every digit before the GPT-2 regex."""
    digit_ids = [smollm_tokenizer.token_to_id(d) for d in digits]
    ids = smollm_tokenizer.encode(text)
    assert None not in digit_ids
    start = next(i for i in range(len(ids)) if ids[i:i + len(digits)] == digit_ids)
    assert smollm_tokenizer.decode(ids[:start]) + digits == text[:text.index(digits) + len(digits)]
    assert smollm_tokenizer.decode(ids) == text


@pytest.mark.slow
def test_special_token_attributes_match_hf(smollm_tokenizer, hf_gguf_tokenizer):
    hf = hf_gguf_tokenizer
    assert smollm_tokenizer.vocab_size == len(hf) == 49152
    assert smollm_tokenizer.bos_token_id == hf.bos_token_id == 1
    assert smollm_tokenizer.eos_token_id == hf.eos_token_id == 2
    assert smollm_tokenizer.eos_token_ids == (2,)
    hf_special = {i for i, tok in hf.added_tokens_decoder.items() if tok.special}
    assert {i for i in range(100) if smollm_tokenizer.is_special(i)} == hf_special
    assert smollm_tokenizer.convert_ids_to_tokens([1, 2, 19556]) == hf.convert_ids_to_tokens(
        [1, 2, 19556])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        smollm_tokenizer.convert_ids_to_tokens([10**6])


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(smollm_tokenizer, hf_gguf_tokenizer, messages,
                                  add_generation_prompt):
    expected = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.slow
def test_hf_directory_tokenizer_matches_hf(hf_gguf_tokenizer, tmp_path):
    """The GGUF-derived HF tokenizer saved with save_pretrained, read back by us."""
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    for text in [*TEXTS, "digits 2024 and 3.14159"]:
        assert ours.encode(text) == hf_gguf_tokenizer(text).input_ids
        ids = hf_gguf_tokenizer(text).input_ids
        assert ours.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == hf_gguf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


# --- pre-tokenizers on a tiny vocabulary ---------------------------------------------


PRE_TEXTS = [
    "the world's 1234 in 12 3",
    "Hello\n\n  world  12345 the",
    "don'T it's WE'LL 7 88 999 the\r\n\r\nend",
    "a\r\nb  \t c   ",
    "<|im_start|>user\nhi<think>x<|im_end|>",
]


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "default"])
def test_pre_tokenizer_matches_hf(tiny_gguf, tiny_tokenizer, pre):
    """HF builds these llama.cpp pre-tokenizers from a GGUF too; both must agree."""
    from transformers import AutoTokenizer

    gguf_file, _ = tiny_gguf("llama", pre=pre)
    hf = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ours = tiny_tokenizer(pre)
    for text in PRE_TEXTS:
        assert ours.encode(text) == hf(text).input_ids, text


def test_smollm_pre_tokenizer_isolates_digits(tiny_tokenizer):
    smollm = tiny_tokenizer("smollm")
    pieces = smollm.convert_ids_to_tokens(smollm.encode("x 123 the"))
    assert pieces == ["x", "Ġ", "1", "2", "3", "Ġthe"]
    gpt2 = tiny_tokenizer("gpt2")  # the vocabulary merges "1 2" and "12 3"
    assert gpt2.convert_ids_to_tokens(gpt2.encode("x 123 the")) == ["x", "Ġ", "123", "Ġthe"]


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_warning(tiny_tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        odd = tiny_tokenizer("no-such-pre")
    assert "no-such-pre" in caplog.text
    gpt2 = tiny_tokenizer("gpt2")
    for text in PRE_TEXTS:
        assert odd.encode(text) == gpt2.encode(text)


def test_sentencepiece_gguf_tokenizer_is_refused_with_a_hint(tiny_tokenizer_meta):
    with pytest.raises(ValueError, match="SentencePiece.*tokenizer="):
        convert_gguf_tokenizer(tiny_tokenizer_meta(model="llama"))
    with pytest.raises(ValueError, match="'bert'.*tokenizer="):
        convert_gguf_tokenizer(tiny_tokenizer_meta(model="bert"))


def test_control_and_user_defined_tokens(tiny_tokenizer):
    tok = tiny_tokenizer()
    think = tok.token_to_id("<think>")
    ids = tok.encode("<|im_start|>user\n<think>the<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and think in ids
    assert tok.is_special(1) and tok.is_special(2) and not tok.is_special(think)
    assert tok.decode(ids) == "user\n<think>the"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\n<think>the<|im_end|>"


def test_add_bos_and_eos_follow_tokenizer_config(tiny_tokenizer):
    plain = tiny_tokenizer().encode("the")
    tok = tiny_tokenizer(add_bos_token=True, add_eos_token=True)
    assert tok.encode("the") == [1, *plain, 2]
    assert tok.encode("the", add_special_tokens=False) == plain


def test_eos_token_ids_extend_without_duplicates(tiny_tokenizer):
    tok = tiny_tokenizer()
    tok.add_eos_token_ids([2, 0, 0])
    assert tok.eos_token_ids == (2, 0)


def test_chat_template_file_and_named_templates(tiny_tokenizer):
    jinja = {"chat_template.jinja": "{{ messages[0]['content'] }}!"}
    tok = tiny_tokenizer(extra_files=jinja, chat_template=[
        {"name": "default", "template": "overridden by chat_template.jinja"},
        {"name": "tool_use", "template": "{{ tools[0]['name'] }}"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   tools=[{"name": "search"}]) == "search"


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# --- chat template rendering against transformers' renderer ---------------------------


TEMPLATES = [
    CHATML,
    # tojson with HF's options, namespace, loop controls, tools, kwargs, special tokens
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}[{{ ns.n }}:{{ m['role'] }}] {{ m['content'] | tojson }}\n"
    "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
    "{{ dict(a=1) | tojson(separators=(',', ':'), sort_keys=True) }}"
    "{% if enable_thinking is defined %}think={{ enable_thinking }}{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}",
    # whitespace control: trim_blocks and lstrip_blocks
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n"
    "U: {{ m.content }}\n    {% else %}\nA: {{ m.content }}\n    {% endif %}\n{% endfor %}",
    # {% generation %} blocks render their body
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
]

MESSAGES = [{"role": "system", "content": "Be nice — always. \"quoted\" <b>"},
            {"role": "skip", "content": "x"},
            {"role": "user", "content": "Ünïcödé 😀 & 中文"},
            {"role": "assistant", "content": "ok"}]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(template, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Météo",
                                               "parameters": {"type": "object"}}}]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    for kwargs in ({}, {"enable_thinking": False}):
        (expected,), _ = render_jinja_template(
            [MESSAGES], tools=tools, chat_template=template,
            add_generation_prompt=add_generation_prompt, **special, **kwargs)
        assert render_chat_template(template, MESSAGES, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    special_tokens=special, **kwargs) == expected


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("final", ["ok", "  Sure, here is "])
def test_continue_final_message_matches_transformers(template, final):
    """The text ends inside the last message, where transformers ends it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [*MESSAGES[:-1], {"role": "assistant", "content": final}]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    (expected,), _ = render_jinja_template([messages], chat_template=template,
                                           continue_final_message=True, **special)
    assert render_chat_template(template, messages, add_generation_prompt=False,
                                continue_final_message=True,
                                special_tokens=special) == expected


def test_continue_final_message_refusals_name_the_field():
    with pytest.raises(ValueError, match="continue_final_message: cannot be true with "
                                         "add_generation_prompt"):
        render_chat_template(CHATML, MESSAGES, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message: the chat template does "
                                         "not render"):
        render_chat_template("{{ 'x' }}", MESSAGES, add_generation_prompt=False,
                             continue_final_message=True)
    for nothing in ([], [{"role": "assistant", "content": " "}]):
        with pytest.raises(ValueError, match="continue_final_message: the last message has "
                                             "no text"):
            render_chat_template(CHATML, nothing, add_generation_prompt=False,
                                 continue_final_message=True)


def test_render_errors_are_value_errors():
    with pytest.raises(ValueError, match="no chat template"):
        render_chat_template(None, MESSAGES)
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", MESSAGES)
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat_template("{% for m in messages %}", MESSAGES)
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat_template("{{ messages.__class__.__mro__ }}", MESSAGES)
    with pytest.raises(ValueError, match="underscore"):
        render_chat_template("{% set ns = namespace(_x=1) %}", MESSAGES)
    with pytest.raises(ValueError, match="list of dicts"):
        render_chat_template(CHATML, ["hello"])


def test_strftime_now_is_available():
    assert render_chat_template("{{ strftime_now('%Y') | length }}", []) == "4"
